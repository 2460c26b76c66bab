"""Triton backend of espert's one kernel: in-place ``w += Σ_m coeffs[m]·ε(seeds[m], key, idx)``.

Bit-identical to ``espert.noise.update_reference`` and to the C++/CUDA kernels
(``csrc/noise.h``): Philox4x32-10 in uint32, a Box-Muller built only from correctly
rounded binary32 + - * / sqrt (``tl.div_rn``, ``tl.sqrt_rn``, launched with
``enable_fp_fusion=False`` so no a*b+c becomes an FMA), and storage rounding by integer
operations.  The float constants are taken from ``espert.noise`` so they cannot drift.

Layout: program i*blocks_per_row + b handles row i of the block and the BLOCK Philox groups
g0 + b*BLOCK + [0, BLOCK), where g0 is the group of the row's first logical element.
Each group's four normals are computed once and interleaved into 4*BLOCK contiguous
elements, so weight loads and stores are contiguous (masked at the row's ends: a row
may start and end mid-group).  Members are looped over inside the program with the sum
kept in registers, so every weight element is read once and written once whatever n is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from espert import noise as _ref

# Storage codes, as in csrc/noise.h.
FLOAT32, FLOAT16, BFLOAT16 = 0, 1, 2

# fp16 <-> fp32 conversions.  True: `.to()`, i.e. `cvt.f32.f16` / `cvt.rn.f16x2.f32` on GPU
# (checked in the PTX for sm_90), numpy in the interpreter: exact widening and IEEE
# round-to-nearest-even narrowing, 2 instructions instead of ~45 per element.  False: integer
# ops mirroring csrc/noise.h f16_to_f32 / f32_to_f16, exact by construction.  Both paths match
# the reference in the interpreter (all 2^16 widenings, 3.5e7 narrowings incl. every rounding
# midpoint); on GPU only NaN payloads can differ (the hardware canonicalizes NaNs anyway).
# Flip to False if the GPU bit-exactness check of fp16 fails.
FP16_HW_CVT = True

# Columns at or past which column arithmetic switches to int64 (a module constant so tests can force it).
INT32_LIMIT = 2**31

# Launch shape on GPU (untuned: no GPU yet).  256 groups on 2 warps = 4 groups (16 elements) per
# thread: ~93-124 registers on sm_90, no spills, and little tail waste on rows like 11008 columns.
# Tests under the interpreter pass their own block.
DEFAULT_BLOCK = 256
NUM_WARPS = 2


def _c(x) -> tl.constexpr:
    return tl.constexpr(float(x))  # exact: every spec constant is a binary32 value


LN2_HI, LN2_LO = _c(_ref.LN2_HI), _c(_ref.LN2_LO)
LOG_C1, LOG_C2, LOG_C3, LOG_C4 = _c(_ref.LOG_C1), _c(_ref.LOG_C2), _c(_ref.LOG_C3), _c(_ref.LOG_C4)
ANGLE_SCALE, UNIFORM_SCALE = _c(_ref.ANGLE_SCALE), _c(_ref.UNIFORM_SCALE)
SIN_C3, SIN_C5, SIN_C7, SIN_C9 = _c(_ref.SIN_C3), _c(_ref.SIN_C5), _c(_ref.SIN_C7), _c(_ref.SIN_C9)
COS_C2, COS_C4, COS_C6 = _c(_ref.COS_C2), _c(_ref.COS_C4), _c(_ref.COS_C6)
COS_C8, COS_C10 = _c(_ref.COS_C8), _c(_ref.COS_C10)
SQRT2_BITS = tl.constexpr(_ref.SQRT2_BITS)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 tensors (broadcastable); returns four uint32 tensors."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo0 = c0 * 0xD2511F53  # uint32: wraps, the low half of the product
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _neg2log_uniform(x):
    """-2 ln u for u = ((x >> 8) + 1) * 2^-24; x uint32 -> float32 (noise.py neg2log_uniform)."""
    u = ((x >> 8) + 1).to(tl.float32) * UNIFORM_SCALE  # both steps exact
    b = u.to(tl.uint32, bitcast=True)
    e = (b >> 23).to(tl.int32) - 127
    mb = (b & 0x007FFFFF) | 0x3F800000
    big = mb > SQRT2_BITS  # m > sqrt(2): halve it so m is in [sqrt(1/2), sqrt(2)]
    mb = tl.where(big, mb - 0x00800000, mb)
    e = tl.where(big, e + 1, e)
    m = mb.to(tl.float32, bitcast=True)
    s = tl.div_rn(m - 1.0, m + 1.0)  # plain `/` is approximate on GPU
    t = s * s
    q = LOG_C4 * t + LOG_C3
    q = q * t + LOG_C2
    q = q * t + LOG_C1
    q = q * t
    s2 = s * 2.0
    log_m = s2 + s2 * q
    ef = e.to(tl.float32)
    ln_u = ef * LN2_HI + (ef * LN2_LO + log_m)
    return ln_u * -2.0


@triton.jit
def _sincos_turn(y):
    """(cos θ, sin θ) for θ = 2π (y >> 8) / 2^24; y uint32 -> two float32 (noise.py sincos_turn)."""
    t = (y >> 8).to(tl.int32)
    quad = (t + (1 << 21)) >> 22  # nearest quarter turn, 0..4; the reduction is exact
    r = t - (quad << 22)
    quad = quad & 3
    a = r.to(tl.float32) * ANGLE_SCALE
    z = a * a
    p = SIN_C9 * z + SIN_C7
    p = p * z + SIN_C5
    p = p * z + SIN_C3
    sin_a = a + (a * z) * p
    p = COS_C10 * z + COS_C8
    p = p * z + COS_C6
    p = p * z + COS_C4
    p = p * z + COS_C2
    cos_a = 1.0 + z * p
    swap = (quad & 1) == 1
    c = tl.where(swap, sin_a, cos_a)
    s = tl.where(swap, cos_a, sin_a)
    c = tl.where((quad == 1) | (quad == 2), -c, c)  # float negation is a sign flip (fneg), exact
    s = tl.where(quad >= 2, -s, s)
    return c, s


@triton.jit
def normals4(seed_lo, seed_hi, key_lo, key_hi, g_lo, g_hi):
    """The four float32 normals of group(s) g = (g_hi << 32) | g_lo (uint32 tensors)."""
    x0, x1, x2, x3 = philox4x32_10(g_lo, g_hi, key_lo, key_hi, seed_lo, seed_hi)
    r0 = tl.sqrt_rn(_neg2log_uniform(x0))  # tl.sqrt is approximate on GPU
    r1 = tl.sqrt_rn(_neg2log_uniform(x2))
    c0, s0 = _sincos_turn(x1)
    c1, s1 = _sincos_turn(x3)
    return r0 * c0, r0 * s0, r1 * c1, r1 * s1


@triton.jit
def member_sum(seeds_ptr, coeffs_ptr, n, key_lo, key_hi, g_lo, g_hi, BLOCK: tl.constexpr):
    """Σ_m coeffs[m]·ε(seeds[m]) for the four lanes of BLOCK groups: the spec's sum, from +0.0 in
    member order, kept in registers.  seeds: int64 bit patterns of uint64; coeffs: float32."""
    acc0 = tl.zeros([BLOCK], tl.float32)
    acc1 = tl.zeros([BLOCK], tl.float32)
    acc2 = tl.zeros([BLOCK], tl.float32)
    acc3 = tl.zeros([BLOCK], tl.float32)
    for m in range(n):
        seed = tl.load(seeds_ptr + m).to(tl.uint64, bitcast=True)
        c = tl.load(coeffs_ptr + m)
        n0, n1, n2, n3 = normals4(seed.to(tl.uint32), (seed >> 32).to(tl.uint32), key_lo, key_hi, g_lo, g_hi)
        acc0 = acc0 + c * n0
        acc1 = acc1 + c * n1
        acc2 = acc2 + c * n2
        acc3 = acc3 + c * n3
    return acc0, acc1, acc2, acc3


# ---- storage formats (bits in uint32 tensors) -----------------------------------------------

@triton.jit
def _f32_to_bf16_bits(x):
    """Round-to-nearest-even float32 -> bfloat16 bits (low 16 bits of a uint32); NaN quiet."""
    b = x.to(tl.uint32, bitcast=True)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, (b >> 16) | 0x40, rounded)


@triton.jit
def _f16_bits_to_f32(h):
    """float16 bits (uint32) -> float32, exactly (csrc/noise.h f16_to_f32)."""
    sign = (h & 0x8000) << 16
    ex = (h >> 10) & 0x1F
    man = h & 0x3FF
    special = sign | 0x7F800000 | (man << 13)  # inf / nan
    normal = sign | ((ex + 112) << 23) | (man << 13)
    sub = sign | (man.to(tl.float32) * UNIFORM_SCALE).to(tl.uint32, bitcast=True)  # man * 2^-24, exact
    bits = tl.where(ex == 0x1F, special, tl.where(ex != 0, normal, sub))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_f16_bits(x):
    """Round-to-nearest-even float32 -> float16 bits (uint32) (csrc/noise.h f32_to_f16)."""
    b = x.to(tl.uint32, bitcast=True)
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    v = a - 0x38000000  # normal half: rebias 127 -> 15, round the 13 dropped bits to nearest even
    normal = (v + 0xFFF + ((v >> 13) & 1)) >> 13
    # subnormal half: shift the full significand right by 14..24 and round to nearest even;
    # the shift is clamped to keep it in range where this lane is not selected anyway
    e = a >> 23
    shift = tl.minimum(tl.maximum(126 - e.to(tl.int32), 1), 31).to(tl.uint32)
    man = (a & 0x7FFFFF) | 0x800000
    half = (1 << (shift - 1)).to(tl.uint32)
    rem = man & ((half << 1) - 1)
    q = man >> shift
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.uint32)
    mag = tl.where(a >= 0x38800000, normal, tl.where(e < 102, 0, sub))
    mag = tl.where(a >= 0x477FF000, 0x7C00, mag)  # rounds to >= 65520: inf
    mag = tl.where(a > 0x7F800000, 0x7E00 | ((a >> 13) & 0x3FF), mag)  # nan, quiet
    return sign | mag


@triton.jit
def _load_f32(ptrs, mask, DTYPE: tl.constexpr, F16_HW: tl.constexpr):
    """Load storage elements (fp32, or 16-bit ones through an int16 pointer) widened to float32."""
    v = tl.load(ptrs, mask=mask)
    if DTYPE == 0:
        return v
    elif DTYPE == 1 and F16_HW:
        return v.to(tl.float16, bitcast=True).to(tl.float32)
    else:
        h = v.to(tl.uint16, bitcast=True).to(tl.uint32)
        if DTYPE == 1:
            return _f16_bits_to_f32(h)
        else:
            return (h << 16).to(tl.float32, bitcast=True)  # bf16 widening: exact shift


@triton.jit
def _store_f32(ptrs, x, mask, DTYPE: tl.constexpr, F16_HW: tl.constexpr):
    """Round float32 to the storage format (nearest even) and store."""
    if DTYPE == 0:
        tl.store(ptrs, x, mask=mask)
    elif DTYPE == 1 and F16_HW:
        tl.store(ptrs, x.to(tl.float16).to(tl.int16, bitcast=True), mask=mask)
    else:
        if DTYPE == 1:
            h = _f32_to_f16_bits(x)
        else:
            h = _f32_to_bf16_bits(x)  # not .to(tl.bfloat16): the interpreter truncates
        tl.store(ptrs, h.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


@triton.jit(do_not_specialize=["row_offset", "col_offset", "logical_cols", "key"])
def _apply_kernel(w_ptr, seeds_ptr, coeffs_ptr, n, cols, row_stride, row_offset, col_offset, logical_cols, key,
                  blocks_per_row, DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
                  BIG: tl.constexpr, F16_HW: tl.constexpr):
    # a 1-D grid: CUDA caps grid dims 1 and 2 at 65535, too few for rows or for the blocks of a long row
    pid = tl.program_id(0)
    row = pid // blocks_per_row
    blk = pid % blocks_per_row
    # logical index of the row's first element, uint64 (offsets may be beyond 2^32)
    base = (row_offset.to(tl.uint64) + row.to(tl.uint64)) * logical_cols.to(tl.uint64) + col_offset.to(tl.uint64)
    g = (base >> 2) + blk.to(tl.uint64) * BLOCK + tl.arange(0, BLOCK).to(tl.uint64)  # [BLOCK] groups
    g_lo = g.to(tl.uint32)
    g_hi = (g >> 32).to(tl.uint32)
    k64 = key.to(tl.uint64)
    key_lo = k64.to(tl.uint32)
    key_hi = (k64 >> 32).to(tl.uint32)

    # columns (inside the block) of this program's 4*BLOCK elements; lane 0 of the row's first
    # group sits `base % 4` columns before column 0
    if BIG:
        blk = blk.to(tl.int64)  # columns beyond 2^31
    col = blk * (4 * BLOCK) + tl.arange(0, 4 * BLOCK)
    if ALIGNED:  # every row starts a group: masks and addresses stay provably aligned
        mask = col < cols
    else:
        col = col - (base & 3).to(col.dtype)
        mask = (col >= 0) & (col < cols)
    ptrs = w_ptr + row.to(tl.int64) * row_stride + col
    x = _load_f32(ptrs, mask, DTYPE, F16_HW)  # issued before the noise math, which hides its latency

    acc0, acc1, acc2, acc3 = member_sum(seeds_ptr, coeffs_ptr, n, key_lo, key_hi, g_lo, g_hi, BLOCK)
    # lanes in element order: interleave(interleave(a0, a2), interleave(a1, a3)) = a0 a1 a2 a3 a0 a1 ...
    acc = tl.interleave(tl.interleave(acc0, acc2), tl.interleave(acc1, acc3))

    _store_f32(ptrs, x + acc, mask, DTYPE, F16_HW)


def apply(w: torch.Tensor, dtype_code: int, rows: int, cols: int, row_stride: int,
          row_offset: int, col_offset: int, logical_cols: int,
          seeds: torch.Tensor, coeffs: torch.Tensor, key: int, *, block: int = DEFAULT_BLOCK) -> None:
    """In place on the block ``w`` ([rows, cols], row stride ``row_stride`` elements, unit column stride):
    ``w[i, j] <- round(float32(w[i, j]) + Σ_m coeffs[m]·ε(seeds[m], key, (row_offset+i)*logical_cols + col_offset + j))``.

    w: float32 / float16 / bfloat16 (``dtype_code`` 0 / 1 / 2), validated by the caller.
    seeds: int64 [n] (uint64 bit patterns); coeffs: float32 [n]; both on w's device.
    key: int in [0, 2^64).  ``block`` (groups per program, a power of two) is a tuning knob.
    """
    assert block & (block - 1) == 0 and 4 * block <= 2**20, "block: a power of two, at most 2^18"
    n = seeds.numel()
    if rows == 0 or cols == 0:
        return
    if w.dtype != torch.float32:  # 16-bit storage travels as int16 bits (see _load_f32)
        w = w.view(torch.int16)
    aligned = logical_cols % 4 == 0 and col_offset % 4 == 0  # then every row starts a group
    groups_per_row = (cols + 3) // 4 if aligned else (cols + 6) // 4  # else a row can start mid-group
    blocks_per_row = triton.cdiv(groups_per_row, block)
    big = cols + 4 * block >= INT32_LIMIT
    grid = (rows * blocks_per_row,)
    _apply_kernel[grid](w, seeds, coeffs, n, cols, row_stride, row_offset, col_offset, logical_cols, key,
                        blocks_per_row,
                        DTYPE=dtype_code, BLOCK=block, ALIGNED=aligned, BIG=big, F16_HW=FP16_HW_CVT,
                        num_warps=NUM_WARPS, enable_fp_fusion=False)
