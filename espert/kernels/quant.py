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
def _lowrank_sum(stage_ptr, b_off, coeffs_ptr, n, rank, N, K, nl, k0, mask, BLOCK: tl.constexpr):
    """Σ_m coeffs[m]·ε_m of lanes k0 .. k0+3 of block rows nl ([BLOCK] each) with lowrank ε from the
    staged factors (quant.h lowrank4): A' [n, N, r] at stage_ptr, Bᵀ [n, r, K] at stage_ptr + b_off;
    ε = Σ_j fl(A'[m, nl, j]·Bᵀ[m, j, k]) from +0 in j order."""
    acc0 = tl.zeros([BLOCK], tl.float32)
    acc1 = tl.zeros([BLOCK], tl.float32)
    acc2 = tl.zeros([BLOCK], tl.float32)
    acc3 = tl.zeros([BLOCK], tl.float32)
    for m in range(n):
        c = tl.load(coeffs_ptr + m)
        a_row = stage_ptr + (m * N + nl) * rank
        b_col = stage_ptr + b_off + m * rank * K + k0
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


@triton.jit(do_not_specialize=["row_offset", "col_offset", "logical_cols", "key", "qmin", "qmax"])
def _quant_kernel(
    codes_ptr,
    scales_ptr,
    master_ptr,
    seeds_ptr,
    coeffs_ptr,
    stage_ptr,
    icdf_ptr,
    b_off,
    rank,
    n_members,
    units,
    N,
    K,
    ld,
    row_offset,
    col_offset,
    logical_cols,
    group,
    scale_ld,
    qmin,
    qmax,
    key,
    ELEM: tl.constexpr,
    LAYOUT: tl.constexpr,
    KIND: tl.constexpr,
    MODE: tl.constexpr,
    FAMILY: tl.constexpr,
    G: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    u = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = u < units
    u = tl.where(mask, u, 0)
    k64 = key.to(tl.uint64)
    key_lo = k64.to(tl.uint32)
    key_hi = (k64 >> 32).to(tl.uint32)
    s0 = tl.load(seeds_ptr).to(tl.uint64, bitcast=True)  # member 0: the SR stream's seed (perturb)
    # int4 units own 1, 4 or 2 words: the word of (group 0, lane l) tells where they are
    if ELEM == INT4:
        n00, k00 = _origin(u, 0, N, K, LAYOUT)
        wa0, _s = _word_of(n00, k00, ld, LAYOUT)
        wa1, _s = _word_of(n00, k00 + 1, ld, LAYOUT)
        wa2, _s = _word_of(n00, k00 + 2, ld, LAYOUT)
        if LAYOUT == MARLIN:  # Marlin: lanes 0, 1 in one word, lanes 2, 3 in the next
            wa1 = wa2
        wa3, _s = _word_of(n00, k00 + 3, ld, LAYOUT)
        w0 = tl.load(codes_ptr + wa0, mask=mask, other=0).to(tl.uint32, bitcast=True)
        if LAYOUT == AWQ or LAYOUT == CPU_W4A16 or LAYOUT == MARLIN:
            w1 = tl.load(codes_ptr + wa1, mask=mask, other=0).to(tl.uint32, bitcast=True)
        if LAYOUT == AWQ or LAYOUT == CPU_W4A16:
            w2 = tl.load(codes_ptr + wa2, mask=mask, other=0).to(tl.uint32, bitcast=True)
            w3 = tl.load(codes_ptr + wa3, mask=mask, other=0).to(tl.uint32, bitcast=True)
    for j in tl.static_range(G):
        n, k0 = _origin(u, j, N, K, LAYOUT)
        base = (
            (row_offset.to(tl.uint64) + n.to(tl.uint64)) * logical_cols.to(tl.uint64)
            + col_offset.to(tl.uint64)
            + k0.to(tl.uint64)
        )
        g = base >> 2
        g_lo = g.to(tl.uint32)
        g_hi = (g >> 32).to(tl.uint32)
        if FAMILY == RADEMACHER:
            a0, a1, a2, a3 = _rademacher_sum(seeds_ptr, coeffs_ptr, n_members, key_lo, key_hi, g, BLOCK)
        elif FAMILY == LOWRANK:
            a0, a1, a2, a3 = _lowrank_sum(stage_ptr, b_off, coeffs_ptr, n_members, rank, N, K, n, k0, mask, BLOCK)
        else:
            a0, a1, a2, a3 = member_sum(
                seeds_ptr, coeffs_ptr, 0, n_members, 1.0, key_lo, key_hi, g_lo, g_hi, icdf_ptr, FAMILY, BLOCK
            )
        if MODE == PERTURB:
            u0, u1, u2, u3 = _sr_uniforms4(s0.to(tl.uint32), (s0 >> 32).to(tl.uint32), key_lo, key_hi, g_lo, g_hi)
        else:
            u0 = a0 * 0.0
            u1 = u0
            u2 = u0
            u3 = u0
        for l in tl.static_range(4):
            if l == 0:
                acc = a0
                uu = u0
            elif l == 1:
                acc = a1
                uu = u1
            elif l == 2:
                acc = a2
                uu = u2
            else:
                acc = a3
                uu = u3
            k = k0 + l
            s = _scale(scales_ptr, n, k, group, scale_ld, mask, KIND)
            mptr = master_ptr + n * K + k
            widx, shift = _word_of(n, k, ld, LAYOUT)
            if ELEM == INT4:
                # which of the unit's words holds (j, l): GPTQ one; AWQ / CPU W4A16 word l; Marlin l // 2
                if LAYOUT == GPTQ:
                    word = w0
                elif LAYOUT == MARLIN:
                    if l < 2:
                        word = w0
                    else:
                        word = w1
                else:
                    if l == 0:
                        word = w0
                    elif l == 1:
                        word = w1
                    elif l == 2:
                        word = w2
                    else:
                        word = w3
                sh = shift.to(tl.uint32)
                code = (word >> sh) & 0xF
                nc = _edit(code, acc, s, uu, mptr, mask, qmin, qmax, ELEM, MODE)
                word = (word & ~(tl.full([BLOCK], 0xF, tl.uint32) << sh)) | (nc << sh)
                if LAYOUT == GPTQ:
                    w0 = word
                elif LAYOUT == MARLIN:
                    if l < 2:
                        w0 = word
                    else:
                        w1 = word
                else:
                    if l == 0:
                        w0 = word
                    elif l == 1:
                        w1 = word
                    elif l == 2:
                        w2 = word
                    else:
                        w3 = word
            else:
                code = tl.load(codes_ptr + widx, mask=mask, other=0).to(tl.uint32)
                nc = _edit(code, acc, s, uu, mptr, mask, qmin, qmax, ELEM, MODE)
                tl.store(codes_ptr + widx, nc.to(tl.uint8), mask=mask)
    if ELEM == INT4:
        tl.store(codes_ptr + wa0, w0.to(tl.int32, bitcast=True), mask=mask)
        if LAYOUT == AWQ or LAYOUT == CPU_W4A16 or LAYOUT == MARLIN:
            tl.store(codes_ptr + wa1, w1.to(tl.int32, bitcast=True), mask=mask)
        if LAYOUT == AWQ or LAYOUT == CPU_W4A16:
            tl.store(codes_ptr + wa2, w2.to(tl.int32, bitcast=True), mask=mask)
            tl.store(codes_ptr + wa3, w3.to(tl.int32, bitcast=True), mask=mask)


def _units(layout: str, n: int, k: int) -> int:
    return {
        "nk": n * (k // 4),
        "kn": n * (k // 4),
        "gptq": n * (k // 8),
        "awq": (n // 8) * (k // 4),
        "cpu_w4a16": (n // 8) * (k // 4),
        "marlin": (n // 64) * (k // 16) * 64,
    }[layout]


def quant_apply(
    geom,
    scales: torch.Tensor,
    master: torch.Tensor | None,
    mode: int,
    seeds: torch.Tensor,
    coeffs: torch.Tensor,
    key: int,
    *,
    family: int = 0,
    rank: int = 0,
    stage: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
) -> None:
    """Run the quantized kernel on a validated geometry (``espert.quant.ops.QGeometry``).

    geom.data: the storage (int8 / uint8 bytes or int32 words); scales: float32/16/bf16; master:
    float32 [N, K] or None; mode: a code of espert._C.QUANT_MODE_CODES; seeds int64 [n]
    (uint64 bit patterns), coeffs float32 [n], on the storage's device (at least one seed for perturb).
    family: a code of espert._C.FAMILY_CODES; lowrank needs ``rank`` and ``stage`` (float32: A' [n, N, r]
    then Bᵀ [n, r, K], from ``espert.ops.lowrank_stage``).
    """
    lowrank = family == _C.FAMILY_CODES["lowrank"]
    assert family in _C.FAMILY_CODES.values() and (not lowrank or stage is not None), f"family code {family}"
    layout = _LAYOUT[geom.layout]
    units = _units(geom.layout, geom.N, geom.K)
    if units == 0:
        return
    if seeds.numel() == 0:  # the SR seed load needs an element; no member means acc = 0
        seeds = torch.zeros(1, dtype=torch.int64, device=seeds.device)
        coeffs_n = 0
    else:
        coeffs_n = seeds.numel()
    data = geom.data.view(torch.uint8) if geom.elem == "int8" else geom.data
    m = master if master is not None else data  # never read unless mode 1
    st = stage if lowrank else m  # never read unless lowrank
    grid = (triton.cdiv(units, block),)
    # Triton launches on the current CUDA device: make it the storage's
    with torch.cuda.device(data.device) if data.is_cuda else contextlib.nullcontext():
        _quant_kernel[grid](
            data,
            scales,
            m,
            seeds,
            coeffs,
            st,
            icdf_table(data.device),
            coeffs_n * rank * geom.N,  # Bᵀ's offset in the stage (elements)
            rank,
            coeffs_n,
            units,
            geom.N,
            geom.K,
            geom.ld,
            geom.row_offset,
            geom.col_offset,
            geom.logical_cols,
            geom.group,
            geom.scale_ld,
            geom.qmin,
            geom.qmax,
            key,
            ELEM=_ELEM[geom.elem],
            LAYOUT=layout,
            KIND=_KIND[geom.scale_kind],
            MODE=mode,
            FAMILY=family,
            G=UNITS_G[layout],
            BLOCK=block,
            enable_fp_fusion=False,
        )
