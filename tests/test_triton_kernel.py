"""The Triton kernel (espert/kernels/apply.py) against the numpy spec, bit for bit, under the Triton interpreter.

Each interpreted program instance costs milliseconds, so tensors are small and blocks large.
NaN weights keep their exact bits (the kernel selects the input's bits for a NaN element).
"""

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import espert.kernels.apply as kmod
from espert import _C, noise
from espert.ops.plan import ONE_BITS, plan_fields, plan_table, units_per_row

pytestmark = [  # inf / NaN / overflow cases are deliberate
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

BLOCK = 256  # groups per program in these tests (1024 elements)
CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
KEY = noise.param_key("model.layers.0.mlp.up_proj.weight")


def apply(
    w: torch.Tensor,
    dtype_code: int,
    rows: int,
    cols: int,
    row_stride: int,
    row_offset: int,
    col_offset: int,
    logical_cols: int,
    seeds: torch.Tensor,
    coeffs: torch.Tensor,
    key: int,
    *,
    block: int | None = None,
    family: int = kmod.GAUSSIAN,
    chunk: int | None = None,
) -> None:
    """One tensor, any family but lowrank (``family``): in place on the block ``w`` ([rows, cols], row
    stride ``row_stride`` elements, unit column stride), ``w[i, j] <- round(float32(w[i, j]) +
    Σ_m coeffs[m]·ε(seeds[m], key, (row_offset+i)*logical_cols + col_offset + j))``.  A one-entry
    plan through :func:`espert.kernels.apply.apply_many`, unchecked (the ops layer validates).
    seeds: int64 [n] (uint64 bit patterns); coeffs: float32 [n]; both on w's device."""
    n = seeds.numel()
    if rows == 0 or cols == 0 or n == 0:
        return
    table = plan_table(
        1,
        data=w.data_ptr(),
        dtype=dtype_code,
        rows=rows,
        cols=cols,
        row_stride=row_stride,
        row_offset=row_offset,
        col_offset=col_offset,
        logical_cols=logical_cols,
        key=key,
        scale_bits=ONE_BITS,
        family=family,
        member_end=n,
        units_per_row=units_per_row(cols, family, block or kmod.DEFAULT_BLOCK),
    )
    kmod.apply_many(
        plan_fields(table), torch.from_numpy(table.copy()).to(w.device), seeds, coeffs, block=block, chunk=chunk
    )


def _to_numpy(w: torch.Tensor) -> np.ndarray:
    """The reference's input format: float32 / float16 arrays, bfloat16 as uint16 bits."""
    w = w.contiguous()
    if w.dtype == torch.bfloat16:
        return w.view(torch.int16).numpy().view(np.uint16)
    return w.numpy()


def _bits(a) -> np.ndarray:
    """Unsigned bit patterns of a tensor or a reference array."""
    if isinstance(a, torch.Tensor):
        a = a.contiguous().view(torch.int32 if a.dtype == torch.float32 else torch.int16).numpy()
    a = np.ascontiguousarray(a)
    return a.view(np.uint32 if a.itemsize == 4 else np.uint16)


def _seeds(seeds) -> torch.Tensor:
    return torch.tensor(np.array(seeds, dtype=np.uint64).view(np.int64))


def check(
    w: torch.Tensor, seeds, coeffs, key=KEY, row_offset=0, col_offset=0, logical_cols=None, block=BLOCK,
    family="gaussian", chunk=None,
):  # fmt: skip
    """Run the kernel in place on ``w`` (1-D, or a 2-D possibly strided view) and compare with the spec."""
    rows, cols = (1, w.shape[0]) if w.dim() == 1 else tuple(w.shape)
    row_stride = cols if w.dim() == 1 else w.stride(0)
    lc = cols if logical_cols is None else logical_cols
    coeffs = np.asarray(coeffs, dtype=np.float32)
    want = noise.update_reference(
        _to_numpy(w), NAMES[w.dtype], seeds, coeffs, key, row_offset, col_offset, lc, noise=family
    )
    want = _bits(want)
    apply(
        w,
        CODES[w.dtype],
        rows,
        cols,
        row_stride,
        row_offset,
        col_offset,
        lc,
        _seeds(seeds),
        torch.tensor(coeffs),
        key,
        block=block,
        family=_C.FAMILY_CODES[family],
        chunk=chunk,
    )
    got = _bits(w)
    bad = got != want
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements differ, first at {np.argwhere(bad)[0]}"


def _weights(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.05).to(dtype)


# ---- Philox known-answer vectors (Random123) ---------------------------------------------------


@triton.jit
def _ld_u32(p):
    return tl.load(p).to(tl.uint32, bitcast=True)


@triton.jit
def _philox_kat_kernel(ctr_ptr, key_ptr, out_ptr):
    i = tl.arange(0, 4)  # one test vector per lane
    x = kmod.philox4x32_10(
        _ld_u32(ctr_ptr + 4 * i),
        _ld_u32(ctr_ptr + 4 * i + 1),
        _ld_u32(ctr_ptr + 4 * i + 2),
        _ld_u32(ctr_ptr + 4 * i + 3),
        _ld_u32(key_ptr + 2 * i),
        _ld_u32(key_ptr + 2 * i + 1),
    )
    tl.store(out_ptr + 4 * i, x[0].to(tl.int32, bitcast=True))
    tl.store(out_ptr + 4 * i + 1, x[1].to(tl.int32, bitcast=True))
    tl.store(out_ptr + 4 * i + 2, x[2].to(tl.int32, bitcast=True))
    tl.store(out_ptr + 4 * i + 3, x[3].to(tl.int32, bitcast=True))


def test_philox_known_answers():
    ctr = [[0, 0, 0, 0], [0xFFFFFFFF] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0, 0, 0, 0]]
    key = [[0, 0], [0xFFFFFFFF] * 2, [0xA4093822, 0x299F31D0], [0, 0]]
    want = [
        [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
        [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
        [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
    ]
    as_i32 = lambda v: torch.tensor(np.array(v, dtype=np.uint32).view(np.int32).ravel())  # noqa: E731
    out = torch.zeros(16, dtype=torch.int32)
    _philox_kat_kernel[(1,)](as_i32(ctr), as_i32(key), out)
    assert out.numpy().view(np.uint32).tolist() == np.array(want, dtype=np.uint32).ravel().tolist()


# ---- the kernel against update_reference -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sign", [1, -1])
def test_perturb_n1(dtype, sign):
    # aligned layout (logical_cols % 4 == 0, col_offset % 4 == 0): the unmasked-start path
    w = _weights((6, 40), dtype)
    check(w, [0x0123456789ABCDEF], [sign * 0.02], row_offset=2, col_offset=8, logical_cols=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_update_n5_mixed(dtype):
    w = _weights((5, 33), dtype, seed=1)
    seeds = [1, 2**64 - 1, 2**63, 12345678901234567, 0]
    check(w, seeds, [0.5, -1e-3, 2.0, -0.75, 3e-5], row_offset=1, col_offset=7, logical_cols=50)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_mid_group_many_programs(dtype):
    # logical_cols not a multiple of 4 and col_offset odd: rows start and end mid-group; block=4
    # gives several programs per row, so program boundaries are crossed too
    w = _weights((7, 37), dtype, seed=2)
    check(w, [77, 78], [0.1, -0.2], row_offset=3, col_offset=5, logical_cols=51, block=4)


def test_aligned_rows_many_programs():
    # aligned rows whose width is a multiple of 4*block: programs tile each row exactly
    check(
        _weights((3, 64), torch.bfloat16, seed=12), [13], [0.25], row_offset=5, col_offset=4, logical_cols=72, block=4
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_strided_view(dtype):
    big = _weights((9, 48), dtype, seed=3)
    before = big.clone()
    view = big[:, 3:40]  # row_stride 48, not the view's width
    assert view.stride() == (48, 1)
    check(view, [5, 6, 7], [0.01, 0.02, -0.03], row_offset=4, col_offset=3, logical_cols=48)
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[:, 3:40] = False
    assert torch.equal(_bits_t(big)[outside], _bits_t(before)[outside]), "wrote outside the view"


CHUNK_CASES = [
    (dtype, family, start, "interpreter")
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for family in ("gaussian", "gaussian-icdf", "rademacher")
    for start in ("aligned", "mid-group")
] + [(torch.bfloat16, family, "aligned", "gpu") for family in ("gaussian", "gaussian-icdf", "rademacher")]


@pytest.mark.parametrize("dtype, family, start, shape", CHUNK_CASES)
def test_units_of_several_chunks(dtype, family, start, shape):
    """Units of several chunks, in the interpreter's shape (1024 elements) and the GPU's (4096): interior
    units (no masks, vector accesses; bf16 as 32-bit words of two elements) where the rows' groups start at
    16-byte-aligned addresses, row ends, and rows whose groups start mid-group (every unit masked); special
    values among them; two members."""
    block, chunk = (None, None) if shape == "interpreter" else kmod.GPU_SHAPE[:2]
    if shape == "gpu" and family == "rademacher":
        chunk = kmod.GPU_SHAPE[2]
    width = 3 * 4 * (block or kmod.DEFAULT_BLOCK) + 37  # three whole units and a partial one per row
    big = _weights((3, width + 3), dtype, seed=21)  # row stride: a multiple of 16 bytes
    big[0, 1000:1008] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, 3e38, -1e-3])
    before = big.clone()
    offsets = dict(row_offset=0, col_offset=0, logical_cols=width) if start == "aligned" else \
        dict(row_offset=2, col_offset=5, logical_cols=width + 9)  # fmt: skip
    check(big[:, :width], [31, 32], [0.5, -0.25], block=block, family=family, chunk=chunk, **offsets)
    assert torch.equal(_bits_t(big)[:, width:], _bits_t(before)[:, width:]), "wrote outside the view"


def _bits_t(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_1d(dtype):
    check(_weights((1001,), dtype, seed=4), [9], [0.05])
    # a 1-D slice of a larger logical vector, starting mid-group
    check(_weights((999,), dtype, seed=5), [9, 10], [0.05, 0.5], col_offset=1234567, logical_cols=10**7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_offsets(dtype):
    # indices near 2^52: row_offset near 2^40, odd logical_cols
    check(_weights((3, 29), dtype, seed=6), [3, 4], [0.3, -0.1], row_offset=2**40 - 2, col_offset=11, logical_cols=4099)
    # a column offset near 2^40 whose rows cross a 2^32 boundary of the group counter (index 2^34)
    check(_weights((2, 300), dtype, seed=7), [3], [0.3], row_offset=0, col_offset=2**34 - 150, logical_cols=2**40 + 3)
    # indices beyond 2^63: uint64 arithmetic, not int64
    check(_weights((2, 21), dtype, seed=8), [3], [-0.3], row_offset=2**40 + 5, col_offset=1, logical_cols=2**23 + 1)


def _special(dtype) -> torch.Tensor:
    """Weights with zeros, -0.0, subnormals (of the storage format), huge values, inf and NaN."""
    if dtype == torch.float16:
        bits = [
            0x0000,
            0x8000,
            0x0001,
            0x8001,
            0x0200,
            0x83FF,
            0x03FF,
            0x0400,
            0x7BFF,
            0xFBFF,
            0x7BFE,
            0x7C00,
            0xFC00,
            0x7E00,
            0x7C01,
            0xFE01,
            0x3C00,
            0xBC00,
            0x1000,
            0x9000,
        ]
    else:  # bfloat16
        bits = [
            0x0000,
            0x8000,
            0x0001,
            0x8001,
            0x0040,
            0x807F,
            0x007F,
            0x0080,
            0x7F7F,
            0xFF7F,
            0x7F7E,
            0x7F80,
            0xFF80,
            0x7FC0,
            0x7F81,
            0xFFC1,
            0x3F80,
            0xBF80,
            0x0100,
            0x8100,
        ]
    rng = np.random.default_rng(10)
    w = np.array(bits * 50, dtype=np.uint16)
    w = w[rng.permutation(w.size)].reshape(20, 50)
    return torch.from_numpy(w.view(np.int16)).view(dtype)


@pytest.mark.parametrize("hw_cvt", [True, False])
def test_fp16_special_values(monkeypatch, hw_cvt):
    monkeypatch.setattr(kmod, "FP16_HW_CVT", hw_cvt)
    # tiny coefficient: subnormal sums and ±0 results; large: 65504 + noise overflows to inf
    check(_special(torch.float16), [21], [1e-7], row_offset=1, col_offset=3, logical_cols=57)
    check(_special(torch.float16), [21, 22], [30.0, -20.0], col_offset=2, logical_cols=50)
    w = _weights((20, 50), torch.float16, seed=11)
    check(w, [23, 24, 25], [0.4, -1e-4, 7e-3], row_offset=2, col_offset=1, logical_cols=55)


def test_bf16_special_values():
    check(_special(torch.bfloat16), [31], [1e-39], row_offset=1, col_offset=3, logical_cols=57)  # fp32 subnormal
    check(_special(torch.bfloat16), [31], [1e-3], col_offset=2, logical_cols=50)
    check(_special(torch.bfloat16), [31, 32], [1e38, 3e38], logical_cols=50)  # overflows to inf


def test_fp32_special_values():
    v = np.array(
        [0.0, -0.0, 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan, 1.0, -1.0, 2.0], dtype=np.float32
    )  # 13 values: each lands in every lane
    w = torch.from_numpy(np.tile(v, 40).reshape(13, 40).copy())
    # ±0 coefficients: the +0.0 start of the sum decides the sign of zero results
    check(w, [41, 42], [0.0, -0.0], logical_cols=40)
    check(w, [41, 42], [1e-44, 1e38], row_offset=3, col_offset=1, logical_cols=43)


@triton.jit
def _convert_kernel(x_ptr, h_ptr, narrow_ptr, widen_ptr, N: tl.constexpr, HW: tl.constexpr):
    i = tl.arange(0, N)
    kmod._store_f32(narrow_ptr + i, tl.load(x_ptr + i), i < N, 1, HW)
    tl.store(widen_ptr + i, kmod._load_f32(h_ptr + i, i < N, 1, HW))


@pytest.mark.parametrize("hw_cvt", [True, False])
def test_fp16_conversions(hw_cvt):
    # widening: all 2^16 fp16 values; narrowing: every rounding midpoint between adjacent fp16 values,
    # and its float32 neighbours, so ties to even, subnormals and overflow to inf are all hit
    h = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(all="ignore"):
        lo = h.view(np.float16).astype(np.float64)
        hi = np.nextafter(h.view(np.float16), np.float16(np.inf)).astype(np.float64)
        mid = ((lo + hi) / 2).astype(np.float32).view(np.uint32)[np.isfinite(lo) & np.isfinite(hi)]
    x = (mid[:, None].astype(np.int64) + np.arange(-1, 2)).astype(np.uint32).ravel()
    N = 2**18
    x = np.concatenate([x, np.array([0x7F800000, 0xFF800000, 0x7FC00000], np.uint32), np.zeros(N, np.uint32)])[:N]
    narrow = torch.empty(N, dtype=torch.int16)
    widen = torch.empty(N, dtype=torch.float32)
    _convert_kernel[(1,)](
        torch.from_numpy(x.view(np.float32)),
        torch.from_numpy(np.resize(h, N).view(np.int16)),
        narrow,
        widen,
        N=N,
        HW=hw_cvt,
    )
    with np.errstate(all="ignore"):
        want = x.view(np.float32).astype(np.float16).view(np.uint16)
    nan = np.isnan(x.view(np.float32))
    got = narrow.numpy().view(np.uint16)
    assert np.array_equal(got[~nan], want[~nan]) and (got[nan] == 0x7E00).all()  # a NaN: the pinned one
    w_want = np.resize(h, N).view(np.float16).astype(np.float32)
    w_nan = np.isnan(w_want)
    w_got = widen.numpy()
    assert (
        np.array_equal(w_got.view(np.uint32)[~w_nan], w_want.view(np.uint32)[~w_nan]) and np.isnan(w_got[w_nan]).all()
    )


def test_empty_is_noop():
    w = torch.zeros(0, 8)
    apply(w, 0, 0, 8, 8, 0, 0, 8, _seeds([1]), torch.tensor([1.0]), KEY)
    w = torch.zeros(4, 8)
    apply(w, 0, 4, 8, 8, 0, 0, 8, _seeds([]), torch.zeros(0), KEY)  # n = 0 adds +0.0
    assert torch.equal(w, torch.zeros(4, 8))


# ---- the GPU code: exact PTX for every (dtype, family) launch of the plan kernel -----------------

APPLY_PTX = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from espert.kernels import apply as k

ICDF = k._C.FAMILY_CODES["gaussian-icdf"]
# every launch variant, and the recording perturb (restore="patch") of two of them
cases = [(dt, fam, False) for dt in (k.FLOAT32, k.FLOAT16, k.BFLOAT16) for fam in (k.GAUSSIAN, k.RADEMACHER, k.LOWRANK, ICDF)]
out = {}
for dt, fam, record in cases + [(k.BFLOAT16, k.GAUSSIAN, True), (k.BFLOAT16, ICDF, True)]:
        const = k.constexprs(dt, fam, record=record)
        sig = dict(k.SIGNATURE, **{c: "constexpr" for c in const})
        out[f"{dt}/{fam}" + ("/record" if record else "")] = triton.compile(ASTSource(fn=k._apply_kernel, signature=sig, constexprs=const),
                                           target=GPUTarget("cuda", 90, 32),
                                           options={"enable_fp_fusion": False, "num_warps": k.NUM_WARPS}).asm["ptx"]
print(json.dumps(out))
"""


def test_apply_kernel_ptx_is_exact_for_every_dtype_and_family():
    """Compiled for sm_90 by Triton's own compiler (a subprocess without TRITON_INTERPRET): no FMA (but
    gaussian-icdf's, which its spec makes), no approximate division or square root, no flush-to-zero, in
    all twelve launch variants and two recording ones (restore="patch")."""
    from test_cuda_ptx import assert_exact_ptx, triton_compiled

    from espert import _C

    ptx = triton_compiled(APPLY_PTX, timeout=900)
    assert len(ptx) == 14
    for name, text in ptx.items():
        assert ".entry" in text, name
        assert_exact_ptx(name, text, icdf=name.split("/")[1] == str(_C.FAMILY_CODES["gaussian-icdf"]))


# ---- JIT specializations: what one ES run would compile ------------------------------------------------

SPECIALIZATIONS = r"""
import json, os
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from espert.kernels import apply as A
from espert import ops

# Triton's own binder for sm_90 (what JITFunction.run keys its cache on), fed every launch the ops make
binder = create_function_from_signature(A._apply_kernel.signature, A._apply_kernel.params,
                                        make_backend(GPUTarget("cuda", 90, 32)))
keys = {}
class Recorder:
    def __getitem__(self, grid):
        def launch(*args, **kw):
            _, spec, opts = binder(*args, **kw)
            key = json.dumps([[str(x) for x in s] for s in spec] + sorted([a, str(b)] for a, b in opts.items()))
            keys[key] = keys.get(key, 0) + 1
        return launch
A._apply_kernel = Recorder()
os.environ["TRITON_INTERPRET"] = "1"  # the backend gate takes CPU tensors; no kernel runs
# a Qwen2/Llama-shaped model: embeddings; per layer q, k, v, o, gate, up, down, two norms, q/k/v biases
H, I = 64, 176
layer = [(H, H), (H // 4, H), (H // 4, H), (H, H), (I, H), (I, H), (H, I), (H,), (H,), (H,), (H // 4,), (H // 4,)]
shapes = [(1000, H)] + layer * 4 + [(H,)]
for dtype in (torch.bfloat16, torch.float32):
    items = [(torch.zeros(s, dtype=dtype), k, None) for k, s in enumerate(shapes)]
    for noise in ("gaussian", "gaussian-icdf", "rademacher", "lowrank:4"):
        for seed in range(3):  # members: the whole model, and one tensor at a time
            ops.perturb_many_(items, seed, 1e-3, noise=noise, backend="triton")
            ops.perturb_many_(items[seed : seed + 1], seed, 1e-3, noise=noise, backend="triton")
        for n in (1, 7, 32):  # updates
            ops.es_update_many_(items, list(range(n)), [1e-3] * n, noise=noise, backend="triton")
print(json.dumps(keys))
"""


def test_an_es_run_compiles_one_triton_variant_per_dtype_and_family():
    """Every launch of perturb and update calls on a model-shaped list (2 dtypes x 4 families, one tensor or
    all, 1 to 32 members) keyed by Triton's own binder for sm_90: one variant per (dtype, family) present,
    the lowrank staging fill sharing float32 Gaussian's.  Before: 14, since n_entries and n_search were
    specialized (the value 1 and multiples of 16 each compile another variant, ~1 s of JIT each)."""
    from test_cuda_ptx import triton_compiled

    keys = triton_compiled(SPECIALIZATIONS)
    pairs = {json.dumps(json.loads(k)[9]) for k in keys}  # the UnitShape constexpr (its DTYPE and FAMILY)
    print(f"\n{len(keys)} Triton variants over {sum(keys.values())} launches")
    assert len(keys) == len(pairs) == 8, sorted(keys)
