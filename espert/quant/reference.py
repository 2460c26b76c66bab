"""The quantized ops' per-element math as a slow numpy reference (unpack -> float -> edit -> repack).

All float arithmetic is binary32, one rounding per operation, in the order written; the C++
(``csrc/quant.h``), CUDA and Triton kernels reproduce it bit for bit.  Per logical element
(n, k) with logical index i, scale s (float32), members (seed_m, c_m):

    acc  = Σ_m c_m·ε(seed_m, key, i)            (float32, from +0, in member order; as the bf16 op;
                                                 ε of the noise family: noise.family_noise)
    v    = acc / s                              (the step in code units)

perturb (one member, c = sign·σ), u = sr_uniform(seed, key, i):
    int8 / int4   code' = clamp(code + floor(v + u), qmin, qmax)
    fp8           x' = clamp(SR_e4m3(e4m3(code) + v, u), ±448)
update with a float32 master M (code units; int: code = M rounded, fp8: value/s):
    M' = clamp(M + v, qmin, qmax);  code' = RNE(M')          (int: integer RNE; fp8: e4m3 RNE)
update "naive" (no master): the same with M = float(code).

RNE(q) for |q| < 2^22 is ``(q + 1.5·2^23) − 1.5·2^23``.  SR_e4m3 / RNE_e4m3 round on the e4m3
grid: with E = max(exponent(|y|), −6) the grid step is 2^(E−3), q = y·2^(3−E) (exact) and the
result is floor(q + u)·2^(E−3) or RNE(q)·2^(E−3) (exact).  fp8 NaN codes are never changed.
"""

from __future__ import annotations

import numpy as np

from espert import noise

_f = np.float32
RNE_MAGIC = _f(12582912.0)  # 1.5 * 2^23
FP8_MAX = _f(448.0)


def rne(q: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest integer, ties to even (valid for |q| < 2^22), as float32."""
    return (q + RNE_MAGIC) - RNE_MAGIC


def e4m3_to_f32(bits: np.ndarray) -> np.ndarray:
    """e4m3fn bit patterns (uint8) -> float32, exact (NaN -> NaN)."""
    b = np.asarray(bits, dtype=np.uint8).astype(np.uint32)
    sign = (b & np.uint32(0x80)) << np.uint32(24)
    e = (b >> np.uint32(3)) & np.uint32(0xF)
    m = b & np.uint32(7)
    normal = sign | ((e + np.uint32(120)) << np.uint32(23)) | (m << np.uint32(20))
    sub = sign | (m.astype(np.float32) * _f(2.0**-9)).view(np.uint32)
    out = np.where(e == 0, sub, normal).view(np.float32)
    return np.where((b & np.uint32(0x7F)) == np.uint32(0x7F), np.float32(np.nan), out)


def e4m3_isnan(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint8) & np.uint8(0x7F)) == np.uint8(0x7F)


def e4m3_round(y: np.ndarray, u: np.ndarray | None = None) -> np.ndarray:
    """y float32 rounded onto the e4m3 grid (no range limit): stochastically with u, else to nearest even."""
    y = np.asarray(y, dtype=np.float32)
    b = y.view(np.uint32) & np.uint32(0x7FFFFFFF)
    e = np.maximum((b >> np.uint32(23)).astype(np.int32) - 127, -6)
    inv = ((127 + 3 - e).astype(np.uint32) << np.uint32(23)).view(np.float32)
    quantum = ((127 + e - 3).astype(np.uint32) << np.uint32(23)).view(np.float32)
    q = y * inv
    r = np.floor(q + u) if u is not None else rne(q)
    return r * quantum


def f32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 values already on the e4m3 grid with |x| <= 448 -> bit patterns (uint8)."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    sign = (b >> np.uint32(24)) & np.uint32(0x80)
    a = b & np.uint32(0x7FFFFFFF)
    sub = (a.view(np.float32) * _f(512.0)).astype(np.uint32)  # 0..8 (8 is 2^-6, encoded 0x08)
    normal = ((a >> np.uint32(20)) - np.uint32(120 << 3)) & np.uint32(0x7F)
    return (sign | np.where(a < np.uint32(0x3C800000), sub, normal)).astype(np.uint8)


def _acc(seeds, coeffs, key: int, idx: np.ndarray, family: str, shape: tuple[int, int]) -> np.ndarray:
    acc = np.zeros(idx.shape, dtype=np.float32)
    for s, c in zip(seeds, coeffs):
        acc = acc + _f(c) * noise.family_noise(family, int(s), key, idx, *shape)
    return acc


def perturb_codes(
    codes: np.ndarray,
    elem: str,
    scales: np.ndarray,
    seed: int,
    key: int,
    coeff: float,
    qmin: float,
    qmax: float,
    idx: np.ndarray,
    family: str = "gaussian",
    shape: tuple[int, int] = (0, 0),
) -> np.ndarray:
    """Perturbed logical codes.  codes [N, K]: int32 (int8/int4) or uint8 e4m3 bits (fp8); scales [N, K]
    float32; coeff = sign·σ; idx [N, K] uint64 logical indices; family: a noise spelling
    (``noise.family_noise``), shape: the logical [R, C] of the parameter (lowrank needs it).
    Returns a new array like ``codes``."""
    v = _acc([seed], [coeff], key, idx, family, shape) / scales.astype(np.float32)
    u = noise.sr_uniform(seed, key, idx)
    if elem == "fp8":
        y = e4m3_to_f32(codes) + v
        r = np.clip(e4m3_round(y, u), -FP8_MAX, FP8_MAX)
        out = f32_to_e4m3(np.where(e4m3_isnan(codes), _f(0), r))
        return np.where(e4m3_isnan(codes), codes, out).astype(np.uint8)
    d = np.floor(v + u)
    x = np.clip(codes.astype(np.float32) + d, _f(qmin), _f(qmax))
    return x.astype(np.int32)


def update_codes(
    codes: np.ndarray,
    master: np.ndarray | None,
    elem: str,
    scales: np.ndarray,
    seeds,
    coeffs,
    key: int,
    qmin: float,
    qmax: float,
    idx: np.ndarray,
    family: str = "gaussian",
    shape: tuple[int, int] = (0, 0),
):
    """The fused ES update.  With ``master`` (float32 [N, K], code units) returns (codes', master');
    without (naive rounding of code + step) returns (codes', None).  family, shape: as :func:`perturb_codes`."""
    v = _acc(seeds, coeffs, key, idx, family, shape) / scales.astype(np.float32)
    nan = e4m3_isnan(codes) if elem == "fp8" else np.zeros(codes.shape, dtype=bool)
    if master is not None:
        base = master.astype(np.float32)
    elif elem == "fp8":
        base = e4m3_to_f32(codes)
    else:
        base = codes.astype(np.float32)
    m = np.clip(base + v, _f(qmin), _f(qmax))
    if elem == "fp8":
        new = f32_to_e4m3(e4m3_round(np.where(nan, _f(0), m)))
        new = np.where(nan, codes, new).astype(np.uint8)
        m = np.where(nan, base, m)
    else:
        new = rne(m).astype(np.int32)
    return new, (m.astype(np.float32) if master is not None else None)
