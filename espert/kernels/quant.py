"""Triton backend of the quantized ops (espert/quant/ops.py): bit-identical to the numpy reference
(``espert/quant/reference.py``) and to the C++/CUDA kernels (``csrc/quant.h``).

Work is split into the same *units* as the C++ kernels: G Philox groups (4 consecutive k of one
row n) that together own whole storage words.  A program handles BLOCK units as [BLOCK] tensors;
the G groups and 4 lanes of a unit are unrolled at compile time, so every Philox call feeds four
elements, and packed int4 words are loaded once, edited in registers nibble by nibble and stored
once (no two programs, nor two lanes, ever write the same word).  Launch with
``enable_fp_fusion=False``; divisions are ``tl.div_rn`` (plain ``/`` is approximate on GPU).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from espert import _C
from espert.kernels.apply import icdf_table, member_sum, philox4x32_10

# The codes of csrc/quant.h, as espert._C exports them (one definition for C++, CUDA and Triton).
_ELEM = dict(_C.QUANT_ELEM_CODES)
_LAYOUT = dict(_C.QUANT_LAYOUT_CODES)
_KIND = dict(_C.QUANT_SCALE_KIND_CODES)
_MODE = dict(_C.QUANT_MODE_CODES)
INT8: tl.constexpr = tl.constexpr(_ELEM["int8"])
FP8: tl.constexpr = tl.constexpr(_ELEM["fp8"])
INT4: tl.constexpr = tl.constexpr(_ELEM["int4"])
NK: tl.constexpr = tl.constexpr(_LAYOUT["nk"])
KN: tl.constexpr = tl.constexpr(_LAYOUT["kn"])
GPTQ: tl.constexpr = tl.constexpr(_LAYOUT["gptq"])
AWQ: tl.constexpr = tl.constexpr(_LAYOUT["awq"])
CPU_W4A16: tl.constexpr = tl.constexpr(_LAYOUT["cpu_w4a16"])
MARLIN: tl.constexpr = tl.constexpr(_LAYOUT["marlin"])
PER_TENSOR: tl.constexpr = tl.constexpr(_KIND["tensor"])
PER_CHANNEL: tl.constexpr = tl.constexpr(_KIND["channel"])
GROUPED: tl.constexpr = tl.constexpr(_KIND["grouped"])
MARLIN_GROUPED: tl.constexpr = tl.constexpr(_KIND["marlin_grouped"])
MARLIN_CHANNEL: tl.constexpr = tl.constexpr(_KIND["marlin_channel"])
PERTURB: tl.constexpr = tl.constexpr(_MODE["perturb"])
MASTER: tl.constexpr = tl.constexpr(_MODE["master"])
NAIVE: tl.constexpr = tl.constexpr(_MODE["naive"])
RADEMACHER: tl.constexpr = tl.constexpr(_C.FAMILY_CODES["rademacher"])
LOWRANK: tl.constexpr = tl.constexpr(_C.FAMILY_CODES["lowrank"])
UNITS_G = {_LAYOUT[name]: g for name, g in _C.QUANT_UNIT_GROUPS.items()}
DEFAULT_BLOCK = 256


@triton.jit
def _sr_uniforms4(seed_lo, seed_hi, key_lo, key_hi, g_lo, g_hi):
    """The four SR uniforms of groups g: Philox with counter high word | 2^31 (g' = g | 2^63)."""
    x0, x1, x2, x3 = philox4x32_10(g_lo, g_hi | 0x80000000, key_lo, key_hi, seed_lo, seed_hi)
    return (
        (x0 >> 8).to(tl.float32) * 5.9604644775390625e-08,
        (x1 >> 8).to(tl.float32) * 5.9604644775390625e-08,
        (x2 >> 8).to(tl.float32) * 5.9604644775390625e-08,
        (x3 >> 8).to(tl.float32) * 5.9604644775390625e-08,
    )


@triton.jit
def _rademacher_sum(seeds_ptr, coeffs_ptr, n, key_lo, key_hi, g, BLOCK: tl.constexpr):
    """Σ_m coeffs[m]·ε(seeds[m]) of the four lanes of groups g (uint64 [BLOCK]) with rademacher ε
    (quant.h rademacher4): a group lies inside one 128-element Philox call h = g >> 5, its lanes are
    bits 4(g & 7) .. 4(g & 7) + 3 of word (g >> 3) & 3; c·(±1) is c with its sign bit flipped, exact."""
    h = (g >> 5) | (1 << 62)
    h_lo = h.to(tl.uint32)
    h_hi = (h >> 32).to(tl.uint32)
    q = ((g >> 3) & 3).to(tl.uint32)
    sh = (4 * (g & 7)).to(tl.uint32)
    acc0 = tl.zeros([BLOCK], tl.float32)
    acc1 = tl.zeros([BLOCK], tl.float32)
    acc2 = tl.zeros([BLOCK], tl.float32)
    acc3 = tl.zeros([BLOCK], tl.float32)
    for m in range(n):
        seed = tl.load(seeds_ptr + m).to(tl.uint64, bitcast=True)
        c = tl.load(coeffs_ptr + m).to(tl.uint32, bitcast=True)
        x0, x1, x2, x3 = philox4x32_10(h_lo, h_hi, key_lo, key_hi, seed.to(tl.uint32), (seed >> 32).to(tl.uint32))
        b = tl.where(q == 0, x0, tl.where(q == 1, x1, tl.where(q == 2, x2, x3))) >> sh
        acc0 = acc0 + (c ^ ((b & 1) << 31)).to(tl.float32, bitcast=True)
        acc1 = acc1 + (c ^ (((b >> 1) & 1) << 31)).to(tl.float32, bitcast=True)
        acc2 = acc2 + (c ^ (((b >> 2) & 1) << 31)).to(tl.float32, bitcast=True)
        acc3 = acc3 + (c ^ (((b >> 3) & 1) << 31)).to(tl.float32, bitcast=True)
    return acc0, acc1, acc2, acc3


@triton.jit
def _lowrank_sum(sa, sb, coeffs_ptr, n, rank, N, K, nl, k0, mask, BLOCK: tl.constexpr):
    """Σ_m coeffs[m]·ε_m of lanes k0 .. k0+3 of block rows nl ([BLOCK] each) with lowrank ε from the
    staged factors (quant.h lowrank4): A' [n, N, r] at sa, Bᵀ [n, r, K] at sb;
    ε = Σ_j fl(A'[m, nl, j]·Bᵀ[m, j, k]) from +0 in j order."""
    acc0 = tl.zeros([BLOCK], tl.float32)
    acc1 = tl.zeros([BLOCK], tl.float32)
    acc2 = tl.zeros([BLOCK], tl.float32)
    acc3 = tl.zeros([BLOCK], tl.float32)
    for m in range(n):
        c = tl.load(coeffs_ptr + m)
        a_row = sa + (m * N + nl) * rank
        b_col = sb + m * rank * K + k0
        t0 = tl.zeros([BLOCK], tl.float32)
        t1 = tl.zeros([BLOCK], tl.float32)
        t2 = tl.zeros([BLOCK], tl.float32)
        t3 = tl.zeros([BLOCK], tl.float32)
        for j in range(rank):
            aj = tl.load(a_row + j, mask=mask, other=0.0)
            bj = b_col + j * K
            t0 = t0 + aj * tl.load(bj, mask=mask, other=0.0)
            t1 = t1 + aj * tl.load(bj + 1, mask=mask, other=0.0)
            t2 = t2 + aj * tl.load(bj + 2, mask=mask, other=0.0)
            t3 = t3 + aj * tl.load(bj + 3, mask=mask, other=0.0)
        acc0 = acc0 + c * t0
        acc1 = acc1 + c * t1
        acc2 = acc2 + c * t2
        acc3 = acc3 + c * t3
    return acc0, acc1, acc2, acc3


@triton.jit
def _floor(x):
    """IEEE floor, subnormals included.  tl.floor compiles to cvt.rmi.ftz.f32.f32 on NVIDIA GPUs, which
    flushes a negative subnormal to -0 (floor 0 instead of -1), unlike C++ floorf and CUDA.  Integer ops:
    truncate, then step down where a negative x had a fraction; |x| >= 2^23 (and inf, NaN) is integral."""
    b = x.to(tl.uint32, bitcast=True)
    mag = b & 0x7FFFFFFF
    big = mag >= 0x4B000000
    t = tl.where(big, 0.0, x).to(tl.int32).to(tl.float32)  # trunc toward zero; exact for |x| < 2^23
    frac = (t.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) != mag
    r = tl.where(((b >> 31) == 1) & frac, t - 1.0, t)
    return tl.where(big | (mag == 0), x, r)  # ±0 keeps its sign, like floorf


@triton.jit
def _rne(q):
    return (q + 12582912.0) - 12582912.0


@triton.jit
def _e4m3_to_f32(h):
    sign = (h & 0x80) << 24
    e = (h >> 3) & 0xF
    m = h & 7
    normal = sign | ((e + 120) << 23) | (m << 20)
    sub = sign | (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    return tl.where(e == 0, sub, normal).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_round(y, u, STOCH: tl.constexpr):
    b = y.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    e = tl.maximum((b >> 23).to(tl.int32) - 127, -6)
    inv = ((130 - e).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    quantum = ((124 + e).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    q = y * inv
    if STOCH:
        r = _floor(q + u)
    else:
        r = _rne(q)
    return r * quantum


@triton.jit
def _f32_to_e4m3(x):
    b = x.to(tl.uint32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    sub = (a.to(tl.float32, bitcast=True) * 512.0).to(tl.uint32)
    normal = ((a >> 20) - 960) & 0x7F
    return sign | tl.where(a < 0x3C800000, sub, normal)


@triton.jit
def _edit(code, acc, s, u, mptr, mask, qmin, qmax, ELEM: tl.constexpr, MODE: tl.constexpr):
    """New code (uint32: int8 as its byte, fp8 bits, int4 nibble) of one element per lane (quant.h edit_code)."""
    v = tl.div_rn(acc, s)
    if ELEM == FP8:
        nan = (code & 0x7F) == 0x7F
        if MODE == PERTURB:
            y = _e4m3_to_f32(code) + v
            new = _f32_to_e4m3(tl.minimum(tl.maximum(_e4m3_round(y, u, True), qmin), qmax))
        else:
            if MODE == MASTER:
                base = tl.load(mptr, mask=mask, other=0.0)
            else:
                base = _e4m3_to_f32(code)
            x = tl.minimum(tl.maximum(base + v, qmin), qmax)
            if MODE == MASTER:
                tl.store(mptr, x, mask=mask & ~nan)
            new = _f32_to_e4m3(_e4m3_round(tl.where(nan, 0.0, x), u, False))
        return tl.where(nan, code, new)
    else:
        if ELEM == INT8:
            c = ((code ^ 0x80).to(tl.int32) - 128).to(tl.float32)  # the byte as a signed int8
        else:
            c = code.to(tl.float32)
        if MODE == PERTURB:
            x = tl.minimum(tl.maximum(c + _floor(v + u), qmin), qmax)
        else:
            if MODE == MASTER:
                base = tl.load(mptr, mask=mask, other=0.0)
            else:
                base = c
            t = tl.minimum(tl.maximum(base + v, qmin), qmax)
            if MODE == MASTER:
                tl.store(mptr, t, mask=mask)
            x = _rne(t)
        xi = x.to(tl.int32)
        if ELEM == INT8:
            return (xi & 0xFF).to(tl.uint32)
        return xi.to(tl.uint32)


@triton.jit
def _origin(u, j: tl.constexpr, N, K, LAYOUT: tl.constexpr):
    """(n, k0) of group j of units u (quant.h Lay<L>::origin)."""
    if LAYOUT == NK:
        n = u // (K // 4)
        k0 = 4 * (u % (K // 4))
    elif LAYOUT == KN:
        n = u % N
        k0 = 4 * (u // N)
    elif LAYOUT == GPTQ:
        n = u % N
        k0 = 8 * (u // N) + 4 * j
    elif LAYOUT == AWQ or LAYOUT == CPU_W4A16:
        n = 8 * (u % (N // 8)) + j
        k0 = 4 * (u // (N // 8))
    else:
        tile = u // 64
        r = u % 64
        w = r % 4
        y = (r // 4) % 2
        x = r // 8
        n = 64 * (tile % (N // 64)) + 16 * w + 8 * (j // 2) + x
        k0 = 16 * (tile // (N // 64)) + 4 * y + 8 * (j % 2)
    return n, k0


@triton.jit
def _word_of(n, k, ld, LAYOUT: tl.constexpr):
    """Storage element (byte or int32 word) and bit shift of logical (n, k) (quant.h Lay<L>::loc)."""
    if LAYOUT == NK:
        return n * ld + k, 0
    elif LAYOUT == KN:
        return k * ld + n, 0
    elif LAYOUT == GPTQ:
        return (k // 8) * ld + n, 4 * (k % 8)
    elif LAYOUT == AWQ:
        t = n % 8
        return k * ld + n // 8, 4 * (t // 2 + 4 * (t % 2))
    elif LAYOUT == CPU_W4A16:
        return (n // 16) * ld + 2 * k + (n % 16) // 8, 4 * (n % 8)
    else:
        kk = k % 16
        nn = n % 64
        th = 4 * (nn % 8) + (kk % 8) // 2
        v = kk % 2 + 2 * (kk // 8) + 4 * ((nn % 16) // 8)
        slot = tl.where(v % 2 == 1, 4 + v // 2, v // 2)
        return (k // 16) * ld + (n // 64) * 128 + 4 * th + nn // 16, 4 * slot


@triton.jit
def _scale(scales_ptr, n, k, group, scale_ld, mask, KIND: tl.constexpr):
    if KIND == PER_TENSOR:
        i = n * 0
    elif KIND == PER_CHANNEL:
        i = n
    elif KIND == GROUPED:
        i = (k // group) * scale_ld + n
    elif KIND == MARLIN_GROUPED:
        nn = n % 64
        i = (k // group) * scale_ld + (n - nn) + 8 * (nn % 8) + nn // 8
    else:
        nn = n % 32
        i = (k // group) * scale_ld + (n - nn) + 8 * ((nn // 2) % 4) + 2 * (nn // 8) + nn % 2
    return tl.load(scales_ptr + i, mask=mask, other=1.0).to(tl.float32)


class QuantShape(NamedTuple):
    """What a launch of :func:`_quant_kernel` specializes on (codes of csrc/quant.h, taken from the row): the
    storage element, layout, scale kind and scale dtype, the mode and the noise family, and the unit's shape
    (G Philox groups per unit, BLOCK units per program)."""

    ELEM: int
    LAYOUT: int
    KIND: int
    SCALE_DTYPE: int
    MODE: int
    FAMILY: int
    G: int
    BLOCK: int


# The row's columns (csrc/quant.h QuantEntry, ``_C.QUANT_FIELDS``): the one struct CPU, CUDA and Triton read.
_QF = {name: tl.constexpr(i) for i, name in enumerate(_C.QUANT_FIELDS)}
Q_CODES, Q_N, Q_K, Q_LD = _QF["codes"], _QF["N"], _QF["K"], _QF["ld"]
Q_ROW_OFFSET, Q_COL_OFFSET, Q_LOGICAL_COLS = _QF["row_offset"], _QF["col_offset"], _QF["logical_cols"]
Q_SCALES, Q_GROUP, Q_SCALE_LD, Q_MASTER = _QF["scales"], _QF["group"], _QF["scale_ld"], _QF["master"]
Q_RANK, Q_STAGE_A, Q_STAGE_B = _QF["rank"], _QF["stage_a"], _QF["stage_b"]
Q_QMIN, Q_QMAX, Q_N_MEMBERS, Q_KEY = _QF["qmin_bits"], _QF["qmax_bits"], _QF["n"], _QF["key"]
SCALE_F32: tl.constexpr = tl.constexpr(_C.DTYPE_CODES["float32"])
SCALE_F16: tl.constexpr = tl.constexpr(_C.DTYPE_CODES["float16"])


@triton.jit
def _ptr(row_ptr, F: tl.constexpr, T: tl.constexpr):
    """The address in column F of the row, as a pointer to T."""
    return tl.load(row_ptr + F).to(tl.pointer_type(T), bitcast=True)


@triton.jit
def _u64(row_ptr, F: tl.constexpr):
    return tl.load(row_ptr + F).to(tl.uint64, bitcast=True)


@triton.jit
def _bits_f32(row_ptr, F: tl.constexpr):
    """A float32 stored as its bits in column F (qmin, qmax)."""
    return tl.load(row_ptr + F).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _scales_ptr(row_ptr, SCALE_DTYPE: tl.constexpr):
    if SCALE_DTYPE == SCALE_F32:
        return _ptr(row_ptr, Q_SCALES, tl.float32)
    elif SCALE_DTYPE == SCALE_F16:
        return _ptr(row_ptr, Q_SCALES, tl.float16)
    else:
        return _ptr(row_ptr, Q_SCALES, tl.bfloat16)


@triton.jit
def _lane(l: tl.constexpr, x0, x1, x2, x3):
    """Lane l's value of four (l: a compile-time lane index)."""
    if l == 0:
        return x0
    elif l == 1:
        return x1
    elif l == 2:
        return x2
    else:
        return x3


@triton.jit
def _word(l: tl.constexpr, LAYOUT: tl.constexpr, w0, w1, w2, w3):
    """The unit's int4 word that holds lane l: GPTQ its one word; AWQ / CPU W4A16 word l; Marlin word l // 2."""
    if LAYOUT == GPTQ:
        return w0
    elif LAYOUT == MARLIN:
        return _lane(l // 2, w0, w1, w2, w3)
    else:
        return _lane(l, w0, w1, w2, w3)


@triton.jit
def _put_word(l: tl.constexpr, LAYOUT: tl.constexpr, word, w0, w1, w2, w3):
    """(w0, w1, w2, w3) with lane l's word (:func:`_word`) replaced by ``word``."""
    if LAYOUT == GPTQ:
        return word, w1, w2, w3
    elif LAYOUT == MARLIN:
        if l < 2:
            return word, w1, w2, w3
        return w0, word, w2, w3
    elif l == 0:
        return word, w1, w2, w3
    elif l == 1:
        return w0, word, w2, w3
    elif l == 2:
        return w0, w1, word, w3
    else:
        return w0, w1, w2, word


@triton.jit
def _int4_words(codes_ptr, u, N, K, ld, mask, LAYOUT: tl.constexpr):
    """Addresses and values of the 1, 2 or 4 int4 words a unit owns: the words of (group 0, lane l) tell where
    they are.  Words a layout does not use repeat word 0 (never stored)."""
    n00, k00 = _origin(u, 0, N, K, LAYOUT)
    wa0, _s = _word_of(n00, k00, ld, LAYOUT)
    wa1, _s = _word_of(n00, k00 + 1, ld, LAYOUT)
    wa2, _s = _word_of(n00, k00 + 2, ld, LAYOUT)
    wa3, _s = _word_of(n00, k00 + 3, ld, LAYOUT)
    if LAYOUT == MARLIN:  # Marlin: lanes 0, 1 in one word, lanes 2, 3 in the next
        wa1 = wa2
    w0 = tl.load(codes_ptr + wa0, mask=mask, other=0).to(tl.uint32, bitcast=True)
    w1, w2, w3 = w0, w0, w0
    if LAYOUT == AWQ or LAYOUT == CPU_W4A16 or LAYOUT == MARLIN:
        w1 = tl.load(codes_ptr + wa1, mask=mask, other=0).to(tl.uint32, bitcast=True)
    if LAYOUT == AWQ or LAYOUT == CPU_W4A16:
        w2 = tl.load(codes_ptr + wa2, mask=mask, other=0).to(tl.uint32, bitcast=True)
        w3 = tl.load(codes_ptr + wa3, mask=mask, other=0).to(tl.uint32, bitcast=True)
    return wa0, wa1, wa2, wa3, w0, w1, w2, w3


@triton.jit
def _store_int4_words(codes_ptr, wa0, wa1, wa2, wa3, w0, w1, w2, w3, mask, LAYOUT: tl.constexpr):
    tl.store(codes_ptr + wa0, w0.to(tl.int32, bitcast=True), mask=mask)
    if LAYOUT == AWQ or LAYOUT == CPU_W4A16 or LAYOUT == MARLIN:
        tl.store(codes_ptr + wa1, w1.to(tl.int32, bitcast=True), mask=mask)
    if LAYOUT == AWQ or LAYOUT == CPU_W4A16:
        tl.store(codes_ptr + wa2, w2.to(tl.int32, bitcast=True), mask=mask)
        tl.store(codes_ptr + wa3, w3.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _group_sums(members, lowrank, icdf_ptr, key_lo, key_hi, g, n, k0, N, K, mask, S: tl.constexpr):
    """Σ_m coeffs[m]·ε_m of the group's four lanes (k0 .. k0+3 of rows n), for the launch's noise family.
    members: (seeds_ptr, coeffs_ptr, n); lowrank: (A' pointer, Bᵀ pointer, rank), read by lowrank only."""
    seeds_ptr, coeffs_ptr, n_members = members
    if S.FAMILY == RADEMACHER:
        return _rademacher_sum(seeds_ptr, coeffs_ptr, n_members, key_lo, key_hi, g, S.BLOCK)
    elif S.FAMILY == LOWRANK:
        sa, sb, rank = lowrank
        return _lowrank_sum(sa, sb, coeffs_ptr, n_members, rank, N, K, n, k0, mask, S.BLOCK)
    else:
        g_lo, g_hi = g.to(tl.uint32), (g >> 32).to(tl.uint32)
        return member_sum(
            seeds_ptr, coeffs_ptr, 0, n_members, 1.0, key_lo, key_hi, g_lo, g_hi, icdf_ptr, S.FAMILY, S.BLOCK
        )


# One kernel body over 1-4 words held in registers: the unit's G groups and 4 lanes are unrolled at compile time
# and edit the same packed words, which are loaded once and stored once (splitting it would round-trip them).
@triton.jit
def _quant_kernel(row_ptr, seeds_ptr, coeffs_ptr, icdf_ptr, units, S: tl.constexpr):
    """The codes of one quantized weight, edited in place: ``row_ptr`` is its QuantEntry (csrc/quant.h, int64
    [len(QUANT_FIELDS)] on the device; its ``seeds``/``coeffs`` columns are unused: the members are
    ``seeds_ptr`` (int64 [n]) and ``coeffs_ptr`` (float32 [n])); ``units``: the weight's units."""
    u = tl.program_id(0).to(tl.int64) * S.BLOCK + tl.arange(0, S.BLOCK).to(tl.int64)
    mask = u < units
    u = tl.where(mask, u, 0)
    N, K, ld = tl.load(row_ptr + Q_N), tl.load(row_ptr + Q_K), tl.load(row_ptr + Q_LD)
    lc, co = _u64(row_ptr, Q_LOGICAL_COLS), _u64(row_ptr, Q_COL_OFFSET)
    ro = _u64(row_ptr, Q_ROW_OFFSET)
    group, scale_ld = tl.load(row_ptr + Q_GROUP), tl.load(row_ptr + Q_SCALE_LD)
    qmin, qmax = _bits_f32(row_ptr, Q_QMIN), _bits_f32(row_ptr, Q_QMAX)
    k64 = _u64(row_ptr, Q_KEY)
    key_lo, key_hi = k64.to(tl.uint32), (k64 >> 32).to(tl.uint32)
    scales_ptr = _scales_ptr(row_ptr, S.SCALE_DTYPE)
    master_ptr = _ptr(row_ptr, Q_MASTER, tl.float32)  # never read unless mode master
    if S.ELEM == INT4:
        codes_ptr = _ptr(row_ptr, Q_CODES, tl.int32)
        wa0, wa1, wa2, wa3, w0, w1, w2, w3 = _int4_words(codes_ptr, u, N, K, ld, mask, S.LAYOUT)
    else:
        codes_ptr = _ptr(row_ptr, Q_CODES, tl.uint8)
    members = (seeds_ptr, coeffs_ptr, tl.load(row_ptr + Q_N_MEMBERS).to(tl.int32))
    lowrank = (_ptr(row_ptr, Q_STAGE_A, tl.float32), _ptr(row_ptr, Q_STAGE_B, tl.float32), tl.load(row_ptr + Q_RANK))
    if S.MODE == PERTURB:
        s0 = tl.load(seeds_ptr).to(tl.uint64, bitcast=True)  # member 0: the SR stream's seed
    for j in tl.static_range(S.G):
        n, k0 = _origin(u, j, N, K, S.LAYOUT)
        g = ((ro + n.to(tl.uint64)) * lc + co + k0.to(tl.uint64)) >> 2
        a0, a1, a2, a3 = _group_sums(members, lowrank, icdf_ptr, key_lo, key_hi, g, n, k0, N, K, mask, S)
        if S.MODE == PERTURB:
            u0, u1, u2, u3 = _sr_uniforms4(
                s0.to(tl.uint32), (s0 >> 32).to(tl.uint32), key_lo, key_hi, g.to(tl.uint32), (g >> 32).to(tl.uint32)
            )
        else:
            u0 = a0 * 0.0
            u1, u2, u3 = u0, u0, u0
        for l in tl.static_range(4):
            acc, uu, k = _lane(l, a0, a1, a2, a3), _lane(l, u0, u1, u2, u3), k0 + l
            s = _scale(scales_ptr, n, k, group, scale_ld, mask, S.KIND)
            mptr = master_ptr + n * K + k
            widx, shift = _word_of(n, k, ld, S.LAYOUT)
            if S.ELEM == INT4:
                sh = shift.to(tl.uint32)
                word = _word(l, S.LAYOUT, w0, w1, w2, w3)
                nc = _edit((word >> sh) & 0xF, acc, s, uu, mptr, mask, qmin, qmax, S.ELEM, S.MODE)
                word = (word & ~(tl.full([S.BLOCK], 0xF, tl.uint32) << sh)) | (nc << sh)
                w0, w1, w2, w3 = _put_word(l, S.LAYOUT, word, w0, w1, w2, w3)
            else:
                code = tl.load(codes_ptr + widx, mask=mask, other=0).to(tl.uint32)
                nc = _edit(code, acc, s, uu, mptr, mask, qmin, qmax, S.ELEM, S.MODE)
                tl.store(codes_ptr + widx, nc.to(tl.uint8), mask=mask)
    if S.ELEM == INT4:
        _store_int4_words(codes_ptr, wa0, wa1, wa2, wa3, w0, w1, w2, w3, mask, S.LAYOUT)


#: _quant_kernel's runtime arguments as Triton types (what a launch passes: the tests compile it with these)
SIGNATURE = {"row_ptr": "*i64", "seeds_ptr": "*i64", "coeffs_ptr": "*fp32", "icdf_ptr": "*i64", "units": "i64"}

#: units of a layout (code) for an [N, K] weight: G groups of 4 elements that own whole storage words
UNITS = {
    _LAYOUT["nk"]: lambda n, k: n * (k // 4),
    _LAYOUT["kn"]: lambda n, k: n * (k // 4),
    _LAYOUT["gptq"]: lambda n, k: n * (k // 8),
    _LAYOUT["awq"]: lambda n, k: (n // 8) * (k // 4),
    _LAYOUT["cpu_w4a16"]: lambda n, k: (n // 8) * (k // 4),
    _LAYOUT["marlin"]: lambda n, k: (n // 64) * (k // 16) * 64,
}


def quant_apply(
    row: np.ndarray, row_dev: torch.Tensor, seeds: torch.Tensor, coeffs: torch.Tensor, block: int = DEFAULT_BLOCK
) -> None:
    """Run the quantized kernel on one validated weight (``espert.quant.ops`` checks and builds its row).

    row: its QuantEntry (csrc/quant.h), int64 [len(QUANT_FIELDS)] on the host (for the launch's
    specialization and grid); row_dev: the same row on the weight's device.  seeds int64 [n] (uint64 bit
    patterns) and coeffs float32 [n] on that device, n the row's ``n`` (at least one element: perturb reads
    seeds[0]).  Lowrank reads A' [n, N, r] at ``stage_a`` and Bᵀ [n, r, K] at ``stage_b`` (float32)."""
    f = {name: int(row[i]) for i, name in enumerate(_C.QUANT_FIELDS)}
    units = UNITS[f["layout"]](f["N"], f["K"])
    if units == 0:
        return
    shape = QuantShape(
        f["elem"], f["layout"], f["scale_kind"], f["scale_dtype"], f["mode"], f["family"], UNITS_G[f["layout"]], block
    )
    # Triton launches on the current CUDA device: make it the storage's
    with torch.cuda.device(row_dev.device) if row_dev.is_cuda else contextlib.nullcontext():
        _quant_kernel[(triton.cdiv(units, block),)](
            row_dev, seeds, coeffs, icdf_table(row_dev.device), units, S=shape, enable_fp_fusion=False
        )
