"""Triton backend of espert's one kernel: in-place ``w += Σ_m c_m·ε(seeds[m], key, idx)`` over a launch plan
(espert/ops/plan.py): one launch per (dtype, noise family) present in a call, whatever the number of tensors.
Each program reads its plan entry through a pointer table (binary search over ``unit_start``).

Bit-identical to ``espert.noise.update_reference`` and to the C++/CUDA kernels
(``csrc/noise.h``): Philox4x32-10 in uint32, a Box-Muller built only from correctly
rounded binary32 + - * / sqrt (``tl.div_rn``, ``tl.sqrt_rn``, launched with
``enable_fp_fusion=False`` so no a*b+c becomes an FMA), and storage rounding by integer
operations.  The float constants are taken from ``espert.noise`` so they cannot drift; the
dtype and family codes and the plan's column order come from ``espert._C``.

Layout: a program owns one unit: row i of an entry and BLOCK Philox groups (4·BLOCK elements;
rademacher: BLOCK/32 whole Philox calls of 128 elements; lowrank: 4·BLOCK columns from column 0), found
once (plan search, row, key) and run in chunks of CHUNK groups.  Per chunk the members are looped over with
the sums kept in registers, so every weight element is read once and written once whatever n is.  A
normal family's thread holds whole groups (its four lanes), a Rademacher thread one Philox word's 32
elements (it computes that word's call only).  Units wholly inside the row from a 16-byte-aligned address
(all of them but the row ends, in the usual tensor) run code of their own without masks and with vector
accesses, bf16 as 32-bit words of two elements (rounded in the high half, as the CUDA kernel does).
A NaN element keeps its bits.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from espert import _C
from espert import noise as _ref

# Storage and family codes and the plan's columns: from the compiled module (csrc/apply.h).
FLOAT32, FLOAT16, BFLOAT16 = (_C.DTYPE_CODES[n] for n in ("float32", "float16", "bfloat16"))
GAUSSIAN, RADEMACHER, LOWRANK = (_C.FAMILY_CODES[n] for n in ("gaussian", "rademacher", "lowrank"))
GAUSSIAN_ICDF: tl.constexpr = tl.constexpr(_C.FAMILY_CODES["gaussian-icdf"])
FLOAT32_CODE: tl.constexpr = tl.constexpr(FLOAT32)
BFLOAT16_CODE: tl.constexpr = tl.constexpr(BFLOAT16)
LOWRANK_CODE: tl.constexpr = tl.constexpr(LOWRANK)
PLAN_FIELDS = tuple(_C.PLAN_FIELDS)
NF = tl.constexpr(len(PLAN_FIELDS))
(
    F_DATA,
    F_DTYPE,
    F_ROWS,
    F_COLS,
    F_ROW_STRIDE,
    F_ROW_OFFSET,
    F_COL_OFFSET,
    F_LOGICAL_COLS,
    F_KEY,
    F_SCALE,
    F_FAMILY,
    F_RANK,
    F_STAGE_A,
    F_STAGE_B,
    F_MEMBER_BEGIN,
    F_MEMBER_END,
    F_UNITS_PER_ROW,
    F_UNIT_START,
) = (
    tl.constexpr(PLAN_FIELDS.index(n))  # by name: the constants follow csrc/apply.h's column order
    for n in (
        "data dtype rows cols row_stride row_offset col_offset logical_cols key scale_bits family rank stage_a "
        "stage_b member_begin member_end units_per_row unit_start"
    ).split()
)

# fp16 <-> fp32 conversions.  True: `.to()`, i.e. `cvt.f32.f16` / `cvt.rn.f16x2.f32` on GPU
# (checked in the PTX for sm_90), numpy in the interpreter: exact widening and IEEE
# round-to-nearest-even narrowing, 2 instructions instead of ~45 per element.  False: integer
# ops mirroring csrc/noise.h f16_to_f32 / f32_to_f16, exact by construction.  Both paths match
# the reference in the interpreter (all 2^16 widenings, 3.5e7 narrowings incl. every rounding
# midpoint); on GPU only NaN payloads can differ (the hardware canonicalizes NaNs anyway).
# Flip to False if the GPU bit-exactness check of fp16 fails.
FP16_HW_CVT = True

# The bits of a NaN the add creates (inf - inf), on every backend (csrc/noise.h kCanonicalNaN).
CANONICAL_NAN: tl.constexpr = tl.constexpr(0x7FC00000)

# Launch shape on GPU (untuned: no GPU yet).  A program owns a unit of DEFAULT_BLOCK groups (4096 elements,
# as the CUDA kernel's), found once by its plan search and run in chunks on 2 warps: CHUNK_GROUPS = 256 groups
# for the normal families and lowrank (4 groups, 16 elements per thread: 94-127 registers on sm_90 in bf16, no
# spills; 8 groups per thread took 128-210 and saved about one instruction per element), RADEMACHER_CHUNK =
# 512 (a thread holds one Philox word's 32 elements; 128 registers).
DEFAULT_BLOCK, CHUNK_GROUPS, RADEMACHER_CHUNK = GPU_SHAPE = (1024, 256, 512)
NUM_WARPS = 2
if os.environ.get("TRITON_INTERPRET") == "1":
    # the interpreter (tests) runs the same code in units of 1024 elements, 4 chunks each (Rademacher 2), so
    # that test-sized tensors have interior units of several chunks besides row ends; the GPU shape is
    # compiled by the PTX and SASS tests and interpreted by tests/test_triton_kernel.py too
    DEFAULT_BLOCK, CHUNK_GROUPS, RADEMACHER_CHUNK = 256, 64, 128


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
        p0 = c0.to(tl.uint64) * 0xD2511F53  # one 32x32->64 multiply (IMAD.WIDE.U32) gives both halves
        p1 = c2.to(tl.uint64) * 0xCD9E8D57
        hi0 = (p0 >> 32).to(tl.uint32)
        hi1 = (p1 >> 32).to(tl.uint32)
        lo0 = p0.to(tl.uint32)
        lo1 = p1.to(tl.uint32)
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
def _icdf_normal(x, icdf_ptr):
    """gaussian-icdf's normal of Philox word(s) x (uint32): noise.h icdf_normal; icdf_ptr: the table as
    int64 [192, 2] (icdf_table)."""
    d = ((x << 1) & 0x00FFFFFE) | 1  # 2 (x & 0x7FFFFF) + 1: odd, 1 .. 2^24 - 1
    b = d.to(tl.int32).to(tl.float32).to(tl.uint32, bitcast=True)  # exact
    row = icdf_ptr + tl.multiple_of(2 * ((b >> 20) - 1016).to(tl.int32), 2)
    y = ((b & 0x000FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    c01, c23 = tl.split(tl.load(row[:, None] + tl.arange(0, 2)[None, :]))  # the row's 16 bytes in one load
    c0 = c01.to(tl.uint32).to(tl.float32, bitcast=True)
    c1 = (c01 >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    c2 = c23.to(tl.uint32).to(tl.float32, bitcast=True)
    c3 = (c23 >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    p = tl.fma(tl.fma(tl.fma(c0, y, c1), y, c2), y, c3)
    return (p.to(tl.uint32, bitcast=True) ^ (x & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def family_normals4(seed_lo, seed_hi, key_lo, key_hi, g_lo, g_hi, icdf_ptr, FAMILY: tl.constexpr):
    """The four normals of group(s) g in a normal family: gaussian (v1) or gaussian-icdf."""
    if FAMILY == GAUSSIAN_ICDF:
        x0, x1, x2, x3 = philox4x32_10(g_lo, g_hi, key_lo, key_hi, seed_lo, seed_hi)
        return (
            _icdf_normal(x0, icdf_ptr),
            _icdf_normal(x1, icdf_ptr),
            _icdf_normal(x2, icdf_ptr),
            _icdf_normal(x3, icdf_ptr),
        )
    else:
        return normals4(seed_lo, seed_hi, key_lo, key_hi, g_lo, g_hi)


_ICDF_TABLES: dict = {}


def icdf_table(device) -> torch.Tensor:
    """gaussian-icdf's coefficient table (espert/icdf_table.py) on ``device``: the float32 [192, 4] rows as
    int64 [192, 2] (two coefficients per 8-byte load, _icdf_normal), made once per device (so a kernel
    launch never copies it: call it before a CUDA graph capture)."""
    key = str(torch.device(device))
    if key not in _ICDF_TABLES:
        _ICDF_TABLES[key] = torch.from_numpy(_ref.ICDF_TABLE_F32.copy()).view(torch.int64).to(device)
    return _ICDF_TABLES[key]


@triton.jit
def _seed_coeff(seeds_ptr, coeffs_ptr, m, scale):
    """Member m's seed (two uint32 halves) and its coefficient times scale."""
    seed = tl.load(seeds_ptr + m).to(tl.uint64, bitcast=True)
    return seed.to(tl.uint32), (seed >> 32).to(tl.uint32), tl.load(coeffs_ptr + m) * scale


@triton.jit
def member_sum(
    seeds_ptr, coeffs_ptr, mb, me, scale, key_lo, key_hi, g_lo, g_hi, icdf_ptr,
    FAMILY: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Σ_m scale·coeffs[m]·ε(seeds[m]) over members [mb, me) for the four lanes of BLOCK groups in normal
    family FAMILY: the spec's sum, from +0.0 in member order, kept in registers.  seeds: int64 bit
    patterns of uint64; coeffs: float32."""
    acc0 = tl.zeros([BLOCK], tl.float32)
    acc1 = tl.zeros([BLOCK], tl.float32)
    acc2 = tl.zeros([BLOCK], tl.float32)
    acc3 = tl.zeros([BLOCK], tl.float32)
    for m in range(mb, me):
        s_lo, s_hi, c = _seed_coeff(seeds_ptr, coeffs_ptr, m, scale)
        n0, n1, n2, n3 = family_normals4(s_lo, s_hi, key_lo, key_hi, g_lo, g_hi, icdf_ptr, FAMILY)
        acc0 = acc0 + c * n0
        acc1 = acc1 + c * n1
        acc2 = acc2 + c * n2
        acc3 = acc3 + c * n3
    return acc0, acc1, acc2, acc3


# ---- storage formats (bits in uint32 tensors) -----------------------------------------------


@triton.jit
def _f32_to_bf16_bits(x):
    """Round-to-nearest-even float32 -> bfloat16 bits (low 16 bits of a uint32); any NaN: 0x7FC0."""
    return _bf16_round_high(x) >> 16


@triton.jit
def _bf16_round_high(x):
    """float32 x rounded to nearest even at bit 16, as uint32 bits: the bf16 result in the high half; any
    NaN: CANONICAL_NAN (csrc/noise.h bf16_round_high)."""
    b = x.to(tl.uint32, bitcast=True)
    return tl.where(x != x, CANONICAL_NAN, b + 0x7FFF + ((b >> 16) & 1))


@triton.jit
def _bf16_add_high(xh, d):
    """bf16 elements kept in the high half of uint32 words: round(x + d) there; a NaN x keeps its bits."""
    x = xh.to(tl.float32, bitcast=True)
    return tl.where(x != x, xh, _bf16_round_high(x + d))


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
    return tl.where(a > 0x7F800000, 0x7E00, sign | mag)  # any NaN: the pinned one


@triton.jit
def _widen(v, DTYPE: tl.constexpr, F16_HW: tl.constexpr):
    """Storage elements (fp32, or 16-bit ones as int16 bits) widened to float32, exactly."""
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
def _narrow(x, DTYPE: tl.constexpr, F16_HW: tl.constexpr):
    """float32 rounded (nearest even) to the storage format: fp32, or 16-bit as int16 bits.  Any NaN
    becomes the pinned one (CANONICAL_NAN; fp16 0x7E00, bf16 0x7FC0)."""
    if DTYPE == 0:
        return tl.where(x != x, CANONICAL_NAN, x.to(tl.uint32, bitcast=True)).to(tl.float32, bitcast=True)
    elif DTYPE == 1 and F16_HW:
        return tl.where(x != x, 0x7E00, x.to(tl.float16).to(tl.int16, bitcast=True)).to(tl.int16)
    else:
        if DTYPE == 1:
            h = _f32_to_f16_bits(x)
        else:
            h = _f32_to_bf16_bits(x)  # not .to(tl.bfloat16): the interpreter truncates
        return h.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _load_f32(ptrs, mask, DTYPE: tl.constexpr, F16_HW: tl.constexpr):
    """Load storage elements (fp32, or 16-bit ones through an int16 pointer) widened to float32."""
    return _widen(tl.load(ptrs, mask=mask), DTYPE, F16_HW)


@triton.jit
def _store_f32(ptrs, x, mask, DTYPE: tl.constexpr, F16_HW: tl.constexpr):
    """Round float32 to the storage format (nearest even) and store."""
    tl.store(ptrs, _narrow(x, DTYPE, F16_HW), mask=mask)


@triton.jit
def _storage_bits(v, DTYPE: tl.constexpr):
    """Storage elements (fp32, or 16-bit as int16) as their zero-extended bits, int64."""
    if DTYPE == 0:
        return v.to(tl.uint32, bitcast=True).to(tl.int64)
    else:
        return v.to(tl.uint16, bitcast=True).to(tl.int64)


@triton.jit
def _record_misses(ptrs, raw, now, acc, live, rec_ptr, capacity, count_ptr, DTYPE: tl.constexpr, F16_HW: tl.constexpr):
    """A recording perturb (restore="patch", csrc/apply.h PatchList): list the elements of ``live`` whose
    subtraction round(now + (0 - acc)) is not ``raw``, one slot reservation per program."""
    y = _widen(now, DTYPE, F16_HW)
    back = tl.where(y != y, now, _narrow(y + (0.0 - acc), DTYPE, F16_HW))
    miss = live & (_storage_bits(back, DTYPE) != _storage_bits(raw, DTYPE))
    flat = tl.reshape(miss, [acc.numel]).to(tl.int64)
    n = tl.sum(flat, axis=0)
    if n > 0:
        slot = tl.atomic_add(count_ptr, n) + tl.cumsum(flat, axis=0) - 1
        ok = (flat != 0) & (slot < capacity)
        addr = tl.reshape(ptrs, [acc.numel]).to(tl.int64, bitcast=True)
        old = tl.reshape(_storage_bits(raw, DTYPE), [acc.numel]) | (DTYPE << 32)
        tl.store(rec_ptr + 2 * slot, addr, mask=ok)
        tl.store(rec_ptr + 2 * slot + 1, old, mask=ok)


@triton.jit
def _add_store(
    row_ptr, col0, cols, offs, acc, rec_ptr, capacity, count_ptr,
    DTYPE: tl.constexpr, F16_HW: tl.constexpr, RECORD: tl.constexpr, INTERIOR: tl.constexpr,
):  # fmt: skip
    """w <- round(w + acc) at columns col0 + offs of a row of ``cols`` elements (offs: int32, acc's
    shape); a NaN keeps its bits.  INTERIOR: the elements lie inside the row from a 16-byte-aligned
    ``row_ptr + col0`` (the caller checked): no masks, vector accesses.  Otherwise masked by bounds.
    RECORD: list the elements subtraction would not restore (_record_misses)."""
    if INTERIOR:
        ptrs = tl.multiple_of(row_ptr + col0, 16) + offs
        raw = tl.load(ptrs)
        live = offs >= 0
    else:  # a row end or an unaligned row: bounds as int32 scalars clamped to [0, numel]
        ptrs = row_ptr + col0 + offs
        lo = tl.minimum(tl.maximum(-col0, 0), acc.numel).to(tl.int32)
        hi = tl.minimum(tl.maximum(cols - col0, 0), acc.numel).to(tl.int32)
        live = (offs >= lo) & (offs < hi)
        raw = tl.load(ptrs, mask=live)
    x = _widen(raw, DTYPE, F16_HW)
    now = tl.where(x != x, raw, _narrow(x + acc, DTYPE, F16_HW))
    tl.store(ptrs, now, mask=None if INTERIOR else live)
    if RECORD:
        _record_misses(ptrs, raw, now, acc, live, rec_ptr, capacity, count_ptr, DTYPE, F16_HW)


@triton.jit
def _add_store_bf16_pairs(row_ptr, col0, offs, acc_lo, acc_hi):
    """An interior bf16 span as 32-bit words of two elements (csrc/cuda add_vec4<kBFloat16>): words
    ``row_ptr + col0`` + offs (``row_ptr + col0`` 16-byte aligned, inside the row) take acc_lo on their
    first (low-half) element and acc_hi on the second, rounded in the high half and packed."""
    ptrs = tl.multiple_of((row_ptr + col0).to(tl.pointer_type(tl.uint32), bitcast=True), 16) + offs
    w = tl.load(ptrs)
    lo = _bf16_add_high(w << 16, acc_lo)
    hi = _bf16_add_high(w & 0xFFFF0000, acc_hi)
    tl.store(ptrs, (hi & 0xFFFF0000) | (lo >> 16))


class UnitShape(NamedTuple):
    """What a launch of :func:`_apply_kernel` specializes on: the storage dtype and noise family (codes), the
    unit (BLOCK Philox groups) and its chunks (CHUNK groups), fp16 conversions in hardware (F16_HW), a
    recording perturb (RECORD, restore="patch")."""

    DTYPE: int
    FAMILY: int
    BLOCK: int
    CHUNK: int
    F16_HW: bool
    RECORD: bool


@triton.jit
def _normal_chunk(k, g0, noise, bufs, S: tl.constexpr):
    """Chunk k's member sums for a normal family: group g holds columns col0 + 4g .. 4g + 3.  Returns (acc
    [CHUNK, 4] in element order, its offsets, bf16 word offsets [CHUNK, 2], lanes (0, 2) and lanes (1, 3))."""
    key_lo, key_hi, scale, mb, me = noise
    seeds_ptr, coeffs_ptr, icdf_ptr = bufs
    gl = tl.arange(0, S.CHUNK)
    g = g0 + (k * S.CHUNK + gl).to(tl.uint64)
    g_lo = g.to(tl.uint32)
    g_hi = (g >> 32).to(tl.uint32)
    acc0, acc1, acc2, acc3 = member_sum(
        seeds_ptr, coeffs_ptr, mb, me, scale, key_lo, key_hi, g_lo, g_hi, icdf_ptr, S.FAMILY, S.CHUNK
    )
    # a group's four lanes stay in its thread (join adds a minor axis): [group, lane], in element
    # order, or as bf16 words [group, word] of lanes (0, 1) and (2, 3)
    acc_lo = tl.join(acc0, acc2)
    acc_hi = tl.join(acc1, acc3)
    pair_offs = 2 * gl[:, None] + tl.arange(0, 2)[None, :]
    acc = tl.reshape(tl.join(acc_lo, acc_hi), [S.CHUNK, 4])
    offs = 4 * gl[:, None] + tl.arange(0, 4)[None, :]
    return acc, offs, pair_offs, acc_lo, acc_hi


@triton.jit
def _rademacher_chunk(k, g0, noise, bufs, S: tl.constexpr):
    """Chunk k's member sums for Rademacher noise, CHUNK // 32 whole Philox calls of 128 elements, returned as
    :func:`_normal_chunk` returns them.  [pair, word]: the chunk's words on the minor axis, so that a thread
    holds a word's 32 elements (bits 2p in acc_lo, 2p + 1 in acc_hi) and computes that word's call only."""
    key_lo, key_hi, scale, mb, me = noise
    seeds_ptr, coeffs_ptr, _icdf = bufs
    NW: tl.constexpr = S.CHUNK // 8
    wd = tl.arange(0, NW)[None, :]
    pr = tl.arange(0, 16)[:, None]
    h = (g0 >> 5) + (k * (S.CHUNK // 32) + (wd >> 2)).to(tl.uint64) | (1 << 62)
    h_lo = h.to(tl.uint32)
    h_hi = (h >> 32).to(tl.uint32)
    q = wd & 3
    up = (31 - 2 * pr).to(tl.uint32)  # bit 2p to bit 31
    acc_lo = tl.zeros([16, NW], tl.float32)
    acc_hi = tl.zeros([16, NW], tl.float32)
    for m in range(mb, me):
        s_lo, s_hi, c = _seed_coeff(seeds_ptr, coeffs_ptr, m, scale)
        x0, x1, x2, x3 = philox4x32_10(h_lo, h_hi, key_lo, key_hi, s_lo, s_hi)
        word = tl.where(q == 0, x0, tl.where(q == 1, x1, tl.where(q == 2, x2, x3)))
        # c·(±1): c with its sign bit flipped by the element's bit, exact
        cb = c.to(tl.uint32, bitcast=True)
        acc_lo = acc_lo + (cb ^ ((word << up) & 0x80000000)).to(tl.float32, bitcast=True)
        acc_hi = acc_hi + (cb ^ ((word << (up - 1)) & 0x80000000)).to(tl.float32, bitcast=True)
    pair_offs = wd * 16 + pr
    acc = tl.join(acc_lo, acc_hi)
    offs = (wd * 32 + 2 * pr)[:, :, None] + tl.arange(0, 2)[None, None, :]
    return acc, offs, pair_offs, acc_lo, acc_hi


@triton.jit
def _lowrank_chunk(e, i, col0, cols, noise, coeffs_ptr, S: tl.constexpr):
    """Row i's chunk from column col0 of a lowrank entry: ε = Σ_j fl(A'[i, j]·Bᵀ[j, col]) from the staged
    A' = K_r·A and Bᵀ.  Returns (acc [4·CHUNK], its offsets)."""
    _key_lo, _key_hi, scale, mb, me = noise
    offs = tl.arange(0, 4 * S.CHUNK)
    inb = offs < tl.minimum(cols - col0, 4 * S.CHUNK).to(tl.int32)
    r = tl.load(e + F_RANK)
    rows = tl.load(e + F_ROWS)
    sa = tl.load(e + F_STAGE_A).to(tl.pointer_type(tl.float32), bitcast=True)
    sb = tl.load(e + F_STAGE_B).to(tl.pointer_type(tl.float32), bitcast=True)
    acc = tl.zeros([4 * S.CHUNK], tl.float32)
    for m in range(mb, me):
        c = tl.load(coeffs_ptr + m) * scale
        mm = m - mb
        a_row = sa + (mm * rows + i) * r
        b_row = sb + mm * r * cols + col0
        t = tl.zeros([4 * S.CHUNK], tl.float32)
        for j in range(r):
            t = t + tl.load(a_row + j) * tl.load(b_row + j * cols + offs, mask=inb, other=0.0)
        acc = acc + c * t
    return acc, offs


@triton.jit
def _unit(e, i, first, cols, g0, row_ptr, noise, bufs, rec, S: tl.constexpr, INTERIOR: tl.constexpr):
    """One launch unit, BLOCK groups from the row's group g0 (its first column ``first``), in chunks of
    CHUNK groups: each chunk's sums over the members, kept in registers, then added to its elements.
    noise: (key_lo, key_hi, scale, first member, end member); bufs: (seeds, coeffs, icdf table);
    rec: (records, capacity, count) of a recording perturb."""
    rec_ptr, capacity, count_ptr = rec
    for k in range(S.BLOCK // S.CHUNK):
        col0 = first + k * (4 * S.CHUNK)
        if col0 < cols:  # a chunk beyond the row's end (never an interior one) has nothing to do
            if S.FAMILY == LOWRANK_CODE:
                acc, offs = _lowrank_chunk(e, i, col0, cols, noise, bufs[1], S)
            elif S.FAMILY == 1:
                acc, offs, pair_offs, acc_lo, acc_hi = _rademacher_chunk(k, g0, noise, bufs, S)
            else:
                acc, offs, pair_offs, acc_lo, acc_hi = _normal_chunk(k, g0, noise, bufs, S)
            if INTERIOR and S.DTYPE == BFLOAT16_CODE and not S.RECORD and S.FAMILY != LOWRANK_CODE:
                _add_store_bf16_pairs(row_ptr, col0, pair_offs, acc_lo, acc_hi)
            else:
                _add_store(
                    row_ptr, col0, cols, offs, acc, rec_ptr, capacity, count_ptr, S.DTYPE, S.F16_HW, S.RECORD, INTERIOR
                )


@triton.jit
def _entry(plan_ptr, n_entries, n_search, u):
    """The plan row of unit u: the last entry whose unit_start <= u (a binary search of n_search steps)."""
    lo = u * 0
    hi = lo + n_entries - 1
    for _ in range(n_search):
        mid = (lo + hi + 1) // 2
        ok = tl.load(plan_ptr + mid * NF + F_UNIT_START) <= u
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return plan_ptr + lo * NF


# n_entries, n_search and capacity change from call to call (and are 1 for one-tensor calls): specialized, each
# value 1 and each multiple of 16 would compile another variant (tests/test_triton_kernel.py counts them)
@triton.jit(do_not_specialize=["n_entries", "n_search", "capacity"])
def _apply_kernel(
    plan_ptr, n_entries, n_search, seeds_ptr, coeffs_ptr, icdf_ptr, rec_ptr, capacity, count_ptr, S: tl.constexpr
):
    """``w += Σ_m c_m·ε_m`` over the units of a launch plan's entries (module docstring); S: :class:`UnitShape`."""
    DTYPE: tl.constexpr = S.DTYPE
    FAMILY: tl.constexpr = S.FAMILY
    BLOCK: tl.constexpr = S.BLOCK
    # a 1-D grid over the units of every entry: CUDA caps grid dims 1 and 2 at 65535
    u = tl.program_id(0).to(tl.int64)
    e = _entry(plan_ptr, n_entries, n_search, u)
    data = tl.load(e + F_DATA)
    if DTYPE == 0:
        w_ptr = data.to(tl.pointer_type(tl.float32), bitcast=True)
    else:  # 16-bit storage travels as int16 bits (see _widen)
        w_ptr = data.to(tl.pointer_type(tl.int16), bitcast=True)
    cols = tl.load(e + F_COLS)
    upr = tl.load(e + F_UNITS_PER_ROW)
    local = u - tl.load(e + F_UNIT_START)
    if tl.load(e + F_ROWS) == 1:  # most entries: one row (contiguous tensors are collapsed to one), no divide
        i = local * 0
    else:
        i = local // upr
    blk = local - i * upr
    # logical index of the row's first element, uint64 (offsets may be beyond 2^63)
    ro = tl.load(e + F_ROW_OFFSET).to(tl.uint64, bitcast=True)
    co = tl.load(e + F_COL_OFFSET).to(tl.uint64, bitcast=True)
    lc = tl.load(e + F_LOGICAL_COLS).to(tl.uint64, bitcast=True)
    base = (ro + i.to(tl.uint64)) * lc + co
    k64 = tl.load(e + F_KEY).to(tl.uint64, bitcast=True)
    key_lo = k64.to(tl.uint32)
    key_hi = (k64 >> 32).to(tl.uint32)
    scale = tl.load(e + F_SCALE).to(tl.int32).to(tl.float32, bitcast=True)
    mb = tl.load(e + F_MEMBER_BEGIN)
    me = tl.load(e + F_MEMBER_END)
    row_ptr = w_ptr + i * tl.load(e + F_ROW_STRIDE)
    # the unit's first column and the row's group it starts at: Philox groups (4 elements) aligned to the
    # logical index, Rademacher's calls of 128 elements too; lowrank groups start at column 0
    if FAMILY == 0 or FAMILY == GAUSSIAN_ICDF:
        shift = (base & 3).to(tl.int64)
        g0 = (base >> 2) + blk.to(tl.uint64) * BLOCK
    elif FAMILY == 1:
        shift = (base & 127).to(tl.int64)
        g0 = ((base >> 7) << 5) + blk.to(tl.uint64) * BLOCK
    else:
        shift = blk * 0
        g0 = blk.to(tl.uint64) * BLOCK
    first = blk * (4 * BLOCK) - shift
    noise, bufs, rec = (
        (key_lo, key_hi, scale, mb, me),
        (seeds_ptr, coeffs_ptr, icdf_ptr),
        (rec_ptr, capacity, count_ptr),
    )
    # the whole unit inside the row at a 16-byte-aligned address (all units but the row ends, in the usual
    # tensor): code without masks and with vector accesses
    if (first >= 0) & (first + 4 * BLOCK <= cols) & ((row_ptr + first).to(tl.int64, bitcast=True) % 16 == 0):
        _unit(e, i, first, cols, g0, row_ptr, noise, bufs, rec, S, True)
    else:
        _unit(e, i, first, cols, g0, row_ptr, noise, bufs, rec, S, False)


#: _apply_kernel's runtime arguments as Triton types (what a launch passes: the tests compile it with these)
SIGNATURE = dict(
    arg.split("=")
    for arg in "plan_ptr=*i64 n_entries=i32 n_search=i32 seeds_ptr=*i64 coeffs_ptr=*fp32 icdf_ptr=*i64 rec_ptr=*i64 "
    "capacity=i64 count_ptr=*i64".split()
)


def constexprs(
    dtype: int, family: int, block: int | None = None, record: bool = False, chunk: int | None = None
) -> dict:
    """_apply_kernel's compile-time arguments for units of ``block`` groups (default DEFAULT_BLOCK) in chunks
    of ``chunk`` (default: the family's, at most ``block``) of ``dtype`` and ``family`` (codes), a recording
    perturb or not."""
    block = block or DEFAULT_BLOCK
    chunk = chunk or min(block, RADEMACHER_CHUNK if family == RADEMACHER else CHUNK_GROUPS)
    assert chunk & (chunk - 1) == 0 and block % chunk == 0, "chunk: a power of two dividing block"
    assert family != RADEMACHER or chunk >= 32, "rademacher needs chunks of whole Philox calls (>= 32 groups)"
    return {"S": UnitShape(dtype, family, block, chunk, FP16_HW_CVT, record)}


def apply_many(
    rows: np.ndarray,
    table_dev: torch.Tensor,
    seeds: torch.Tensor,
    coeffs: torch.Tensor,
    *,
    block: int | None = None,
    chunk: int | None = None,
    patch=None,
) -> None:
    """One launch over plan entries that share a dtype and a family (espert/ops builds and checks
    them, with units of ``block`` groups).  rows: the host plan rows, typed ([E] of
    ``espert.ops.plan.PLAN_DTYPE``: ``plan_fields`` of the int64 table), for the grid; table_dev: the
    same table as int64 [E, len(PLAN_FIELDS)] on the weights' device; seeds: int64 [N] (uint64 bits);
    coeffs: float32 [N], both on the weights' device.  ``block``: groups per program (default
    DEFAULT_BLOCK), a power of two (>= 32 for rademacher), at most 2^18; ``chunk``: groups a program
    computes at a time (default: the family's, :func:`constexprs`).  ``patch``: a recording perturb's
    :class:`espert.ops.patch.PatchList` (its records and count device-writable)."""
    block = block or DEFAULT_BLOCK
    assert block & (block - 1) == 0 and 4 * block <= 2**20, "block: a power of two, at most 2^18"
    if len(rows) == 0:
        return
    dtype, family = int(rows["dtype"][0]), int(rows["family"][0])
    live = rows["member_end"] > rows["member_begin"]
    units = int((rows["unit_start"] + np.where(live, rows["rows"] * rows["units_per_row"], 0)).max())
    if units == 0:
        return
    n_search = max(1, int(len(rows) - 1).bit_length())
    _apply_kernel[(units,)](
        table_dev,
        len(rows),
        n_search,
        seeds,
        coeffs,
        icdf_table(seeds.device),
        seeds if patch is None else patch.records,  # unread when RECORD is off
        0 if patch is None else patch.capacity,
        seeds if patch is None else patch.count,
        **constexprs(dtype, family, block, record=patch is not None, chunk=chunk),
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )


@triton.jit
def _patch_kernel(rec_ptr, n, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = j < n
    addr = tl.load(rec_ptr + 2 * j, mask=ok, other=0)
    v = tl.load(rec_ptr + 2 * j + 1, mask=ok, other=0)
    wide = (v >> 32) == FLOAT32_CODE
    tl.store(addr.to(tl.pointer_type(tl.int32), bitcast=True), v.to(tl.int32), mask=ok & wide)
    tl.store(addr.to(tl.pointer_type(tl.int16), bitcast=True), v.to(tl.int16), mask=ok & ~wide)


def apply_patch(records: torch.Tensor, n: int) -> None:
    """Write records [0, n) of a patch list (int64 [capacity, 2], device-readable: address, old bits |
    dtype << 32) back to their elements."""
    if n > 0:
        _patch_kernel[(triton.cdiv(n, 256),)](records, n, BLOCK=256)
