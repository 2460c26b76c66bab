"""The noise spec, as a slow and obviously-correct numpy reference.

ε(seed, key, i) is a pure function of a 64-bit seed, a 64-bit parameter key and
a 64-bit logical element index.  Every backend (C++ CPU, CUDA, Triton) must
reproduce these numbers bit for bit; ``docs/noise.md`` states the spec in words
and ``tests/golden/noise_v1.json`` pins it.

Recipe (all float arithmetic is IEEE binary32, round-to-nearest-even, one
rounding per operation, no fused multiply-add):

1. Philox4x32-10 with key (seed_lo, seed_hi) and counter
   (g_lo, g_hi, key_lo, key_hi), where g = i // 4 is the group of four
   consecutive logical elements.  It yields four uint32 words x0..x3.
2. Box-Muller on (x0, x1) gives the normals of lanes 0 and 1, on (x2, x3)
   those of lanes 2 and 3.  Lane = i % 4.
   - radius word x: u = ((x >> 8) + 1) * 2^-24 in (0, 1];  R = sqrt(-2 ln u)
   - angle word y: t = y >> 8, θ = 2π t / 2^24;  lane 0/2 get R cos θ, 1/3 get R sin θ.
   ln, sin and cos are short polynomials defined below, built only from
   correctly-rounded + - * / sqrt and exact integer/bit operations.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .icdf_table import ICDF_TABLE

SPEC_VERSION = 1

# Philox4x32-10 constants (Salmon et al. 2011, Random123).
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

_f = np.float32
_U32 = np.uint64(0xFFFFFFFF)


def _hexf(s: str) -> np.float32:
    """A binary32 constant from its hex-float spelling (exact by construction)."""
    v = _f(float.fromhex(s))
    assert float(v) == float.fromhex(s), s
    return v


# ln: x = 2^e * m, m in [sqrt(1/2), sqrt(2)); ln m = 2 atanh(s), s = (m-1)/(m+1).
LN2_HI = _hexf("0x1.62e400p-1")  # ln 2, high part with zero low bits (e * LN2_HI exact)
LN2_LO = _hexf("0x1.7f7d1cp-20")  # ln 2 - LN2_HI
LOG_C1 = _hexf("0x1.555556p-2")  # 1/3
LOG_C2 = _hexf("0x1.99999ap-3")  # 1/5
LOG_C3 = _hexf("0x1.24924ap-3")  # 1/7
LOG_C4 = _hexf("0x1.c71c72p-4")  # 1/9
SQRT2_BITS = 0x3FB504F3  # bits of sqrt(2) rounded to binary32
TWO = _f(2.0)
ONE = _f(1.0)
MINUS_TWO = _f(-2.0)
# sin/cos of a in [-π/4, π/4): Taylor polynomials, a = r * ANGLE_SCALE, r in [-2^21, 2^21).
ANGLE_SCALE = _hexf("0x1.921fb6p-22")  # 2π / 2^24
SIN_C3 = _hexf("-0x1.555556p-3")  # -1/3!
SIN_C5 = _hexf("0x1.111112p-7")  # 1/5!
SIN_C7 = _hexf("-0x1.a01a02p-13")  # -1/7!
SIN_C9 = _hexf("0x1.71de3ap-19")  # 1/9!
COS_C2 = _hexf("-0x1.000000p-1")  # -1/2!
COS_C4 = _hexf("0x1.555556p-5")  # 1/4!
COS_C6 = _hexf("-0x1.6c16c2p-10")  # -1/6!
COS_C8 = _hexf("0x1.a01a02p-16")  # 1/8!
COS_C10 = _hexf("-0x1.27e4fcp-22")  # -1/10!
UNIFORM_SCALE = _hexf("0x1p-24")

ICDF_ROWS = 192  # gaussian-icdf: 24 binades of d = 2v + 1, 8 rows each
ICDF_TABLE_F32 = np.array(ICDF_TABLE, dtype=np.uint32).view(np.float32)


def param_key(name: str) -> int:
    """64-bit key of a logical parameter name: the first 8 bytes of SHA-256(utf-8 name), little endian.

    Stable across processes, Python versions and machines (unlike ``hash``).
    """
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")


def _mulhilo(a: np.ndarray, m: int):
    p = a.astype(np.uint64) * np.uint64(m)
    return (p >> np.uint64(32)).astype(np.uint32), (p & _U32).astype(np.uint32)


def philox4x32_10(counter, key):
    """Philox4x32-10.  counter: 4 uint32 arrays (broadcastable); key: 2 uint32 arrays.

    Returns four uint32 arrays.  Matches the Random123 known-answer vectors.
    """
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) for k in key)
    c0, c1, c2, c3 = np.broadcast_arrays(c0, c1, c2, c3)
    for r in range(PHILOX_ROUNDS):
        kr0 = ((k0 + np.uint64(r * PHILOX_W0)) & _U32).astype(np.uint32)
        kr1 = ((k1 + np.uint64(r * PHILOX_W1)) & _U32).astype(np.uint32)
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ kr0, lo1, hi0 ^ c3 ^ kr1, lo0
    return c0, c1, c2, c3


def _split64(v) -> tuple[np.ndarray, np.ndarray]:
    v = np.asarray(v, dtype=np.uint64)
    return (v & _U32).astype(np.uint32), (v >> np.uint64(32)).astype(np.uint32)


def philox_words(seed: int, key: int, group) -> tuple[np.ndarray, ...]:
    """The four uint32 words of group(s) ``group`` (uint64 array) for (seed, key)."""
    g_lo, g_hi = _split64(group)
    s_lo, s_hi = _split64(np.uint64(seed))
    k_lo, k_hi = _split64(np.uint64(key))
    return philox4x32_10((g_lo, g_hi, k_lo, k_hi), (s_lo, s_hi))


def neg2log_uniform(x: np.ndarray) -> np.ndarray:
    """-2 ln u for u = ((x >> 8) + 1) * 2^-24, x uint32.  Result float32 in [0, 33.3]."""
    k = (x >> np.uint32(8)) + np.uint32(1)  # 1 .. 2^24, exact in binary32
    u = k.astype(np.float32) * UNIFORM_SCALE
    b = u.view(np.uint32)
    e = (b >> np.uint32(23)).astype(np.int32) - np.int32(127)
    mb = (b & np.uint32(0x007FFFFF)) | np.uint32(0x3F800000)
    big = mb > np.uint32(SQRT2_BITS)
    mb = np.where(big, mb - np.uint32(0x00800000), mb)
    e = np.where(big, e + np.int32(1), e)
    m = mb.view(np.float32)
    s = (m - ONE) / (m + ONE)
    t = s * s
    q = LOG_C4
    q = q * t + LOG_C3
    q = q * t + LOG_C2
    q = q * t + LOG_C1
    q = q * t
    s2 = s * TWO
    log_m = s2 + s2 * q
    ef = e.astype(np.float32)
    ln_u = ef * LN2_HI + (ef * LN2_LO + log_m)
    return ln_u * MINUS_TWO


def sincos_turn(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cos θ, sin θ) for θ = 2π (y >> 8) / 2^24, y uint32.  Quadrant reduction is exact."""
    t = (y >> np.uint32(8)).astype(np.int32)  # 0 .. 2^24-1
    quad = (t + np.int32(1 << 21)) >> np.int32(22)  # 0..4, nearest quarter turn
    r = t - (quad << np.int32(22))  # -2^21 .. 2^21-1
    quad = quad & np.int32(3)
    a = r.astype(np.float32) * ANGLE_SCALE  # [-π/4, π/4)
    z = a * a
    p = SIN_C9
    p = p * z + SIN_C7
    p = p * z + SIN_C5
    p = p * z + SIN_C3
    sin_a = a + (a * z) * p
    p = COS_C10
    p = p * z + COS_C8
    p = p * z + COS_C6
    p = p * z + COS_C4
    p = p * z + COS_C2
    cos_a = ONE + z * p
    # rotate by quad quarter turns: (c, s) -> (-s, c) -> (-c, -s) -> (s, -c)
    swap = (quad & np.int32(1)) == 1
    c = np.where(swap, sin_a, cos_a)
    s = np.where(swap, cos_a, sin_a)
    c = np.where((quad == 1) | (quad == 2), -c, c)
    s = np.where(quad >= 2, -s, s)
    return c, s


def normals4(seed: int, key: int, group) -> np.ndarray:
    """The four normals of each group: float32 array of shape group.shape + (4,)."""
    x0, x1, x2, x3 = philox_words(seed, key, group)
    out = []
    for xr, xa in ((x0, x1), (x2, x3)):
        radius = np.sqrt(neg2log_uniform(xr))
        c, s = sincos_turn(xa)
        out += [radius * c, radius * s]
    return np.stack(out, axis=-1)


def _lane(values: np.ndarray, lane) -> np.ndarray:
    """values[..., lane] per element: values [..., 4], lane an integer array of values' leading shape."""
    return np.take_along_axis(values, np.asarray(lane).astype(np.int64)[..., None], -1)[..., 0]


def normal(seed: int, key: int, index) -> np.ndarray:
    """ε(seed, key, index) for an array of logical element indices (uint64).  float32."""
    index = np.asarray(index, dtype=np.uint64)
    n4 = normals4(seed, key, index >> np.uint64(2))
    return _lane(n4, index & np.uint64(3))


# ---- gaussian-icdf: one normal per word by a piecewise-cubic inverse CDF (docs/noise.md §5.4) ----


def fma32(a, b, c) -> np.ndarray:
    """round_binary32(a·b + c) computed exactly (IEEE fused multiply-add), a, b, c float32 arrays.

    a·b is exact in float64 (48 significant bits); TwoSum gives the exact error e of s = fl64(a·b + c),
    and rounding s to odd (its last bit set when e ≠ 0) before rounding to binary32 gives the correctly
    rounded result (Boldo and Melquiond 2008: 53 ≥ 24 + 2 bits).  Plain float64 would round twice.
    """
    a, b, c = (np.asarray(v, dtype=np.float32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    even = (np.asarray(s).view(np.uint64) & np.uint64(1)) == 0
    s = np.where((e != 0) & even, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def icdf_from_word(x) -> np.ndarray:
    """ε of gaussian-icdf from a Philox word x (uint32 array): float32 of x's shape.

    |ε| ≈ Φ⁻¹(1 − d·2⁻²⁵) for d = 2v + 1, v = x & 0x7FFFFF (d·2⁻²⁵ is the upper tail's probability),
    by the cubic of row j of ``ICDF_TABLE`` (espert/icdf_table.py) in y ∈ [1, 2); the sign is bit 31 of x.
    """
    x = np.asarray(x, dtype=np.uint32)
    j, y = _icdf_row_y(((x << np.uint32(1)) & np.uint32(0x00FFFFFE)) | np.uint32(1))  # d = 2v + 1
    p = _icdf_cubic(ICDF_TABLE_F32[j], y)
    return (p.view(np.uint32) ^ (x & np.uint32(0x80000000))).view(np.float32)


def _icdf_row_y(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Table row j (int64) and y in [1, 2) (float32) of tail distances d (odd uint32, 1 … 2^24 − 1)."""
    b = d.astype(np.float32).view(np.uint32)  # exact
    j = ((b >> np.uint32(20)) - np.uint32(1016)).astype(np.int64)  # 8·binade + top 3 mantissa bits
    return j, ((b & np.uint32(0x000FFFFF)) | np.uint32(0x3F800000)).view(np.float32)


def _icdf_cubic(c: np.ndarray, y: np.ndarray) -> np.ndarray:
    """fma(fma(fma(c3, y, c2), y, c1), y, c0) for rows c [..., 4] = (c3, c2, c1, c0) (float32)."""
    c = np.broadcast_to(c, np.shape(y) + (4,))
    return fma32(fma32(fma32(c[..., 0], y, c[..., 1]), y, c[..., 2]), y, c[..., 3])


def normal_icdf(seed: int, key: int, index) -> np.ndarray:
    """ε of gaussian-icdf at logical element(s) ``index`` (uint64): word ``index & 3`` of the same
    Philox call as the v1 normal (group index >> 2), through ``icdf_from_word``.  float32."""
    index = np.asarray(index, dtype=np.uint64)
    words = np.stack(philox_words(seed, key, index >> np.uint64(2)), axis=-1)
    x = _lane(words, index & np.uint64(3))
    return icdf_from_word(x)


def fit_icdf_table() -> np.ndarray:
    """How espert/icdf_table.py was made (``python -m espert.noise icdf-table``): per row j, a least-squares
    cubic in y through Φ⁻¹ at the row's inputs (all of them, or 2049 spread evenly), its coefficients
    rounded to binary32, then c0 moved to centre the error.  The committed table is the spec, not this
    fit (LAPACK may differ in the last bits between machines).  Returns float32 [192, 4] (c3, c2, c1, c0).
    """
    import statistics

    inv = statistics.NormalDist().inv_cdf
    d = np.arange(1, 1 << 24, 2, dtype=np.uint32)
    row, _ = _icdf_row_y(d)
    table = np.zeros((ICDF_ROWS, 4), dtype=np.float32)
    for j in range(ICDF_ROWS):
        dj = d[row == j]
        if len(dj) == 0:
            continue  # no input reaches the row: zeros
        dj = dj[np.unique(np.linspace(0, len(dj) - 1, min(len(dj), 2049)).round().astype(np.int64))]
        _, y = _icdf_row_y(dj)
        g = np.array([-inv(float(v) * 2.0**-25) for v in dj])
        k = min(3, len(dj) - 1)
        c = np.linalg.lstsq(np.vander(y.astype(np.float64), k + 1), g, rcond=None)[0]
        c = np.concatenate([np.zeros(3 - k), c]).astype(np.float32)
        err = _icdf_cubic(c, y).astype(np.float64) - g
        c[3] = np.float32(float(c[3]) - (err.max() + err.min()) / 2)
        table[j] = c
    return table


def render_icdf_table(table: np.ndarray) -> tuple[str, str]:
    """The two committed forms of the table: (espert/icdf_table.py, csrc/icdf_table.h)."""
    bits = np.asarray(table, dtype=np.float32).view(np.uint32)
    rows = ["(" + ", ".join(f"0x{int(v):08X}" for v in r) + ")" for r in bits]
    head = "gaussian-icdf's coefficient table (docs/noise.md §5.4): row j holds the bits of (c3, c2, c1, c0).\n"
    gen = "Generated by `python -m espert.noise icdf-table` (espert.noise.fit_icdf_table); do not edit.\n"
    py = f'"""{head}{gen}"""\n\nICDF_TABLE = (\n' + "".join(f"    {r},\n" for r in rows) + ")\n"
    body = " \\\n".join("  {" + ", ".join(f"0x{int(v):08X}u" for v in r) + "}," for r in bits)
    h = f"// {head}// {gen}#pragma once\n\n// clang-format off\n#define ESPERT_ICDF_TABLE \\\n{body}\n// clang-format on\n"
    return py, h


def block_indices(shape: tuple[int, ...], row_offset: int = 0, col_offset: int = 0, logical_cols: int | None = None):
    """Logical element indices of a [rows, cols] block at (row_offset, col_offset) inside a
    logical [R, logical_cols] matrix.  1-D tensors are one row.  Returns a uint64 array of ``shape``."""
    rows, cols = (1, shape[0]) if len(shape) == 1 else (int(np.prod(shape[:-1])), shape[-1])
    C = cols if logical_cols is None else logical_cols
    r = np.arange(rows, dtype=np.uint64)[:, None] + np.uint64(row_offset)
    c = np.arange(cols, dtype=np.uint64)[None, :] + np.uint64(col_offset)
    return (r * np.uint64(C) + c).reshape(shape)


# ---- the stochastic-rounding stream (quantized weights; docs/noise.md §4) ---------------------

SR_STREAM_BIT = np.uint64(1 << 63)  # groups are < 2^62, so (g | 2^63) never meets a normal's counter


def sr_uniform(seed: int, key: int, index) -> np.ndarray:
    """u(seed, key, index) in [0, 1): the stochastic-rounding uniform of logical element(s) ``index``.

    Same Philox key (seed) and counter layout as ε, with group g' = (index >> 2) | 2^63 (a stream
    disjoint from the normals'); lane index & 3 picks the word x and u = (x >> 8) * 2^-24 (exact).
    index: uint64 array.  Returns float32 of index's shape.
    """
    index = np.asarray(index, dtype=np.uint64)
    words = np.stack(philox_words(seed, key, (index >> np.uint64(2)) | SR_STREAM_BIT), axis=-1)
    x = _lane(words, index & np.uint64(3))
    return (x >> np.uint32(8)).astype(np.float32) * UNIFORM_SCALE


# ---- noise families (docs/noise.md §5) --------------------------------------------------------

FAMILIES = ("gaussian", "rademacher", "lowrank", "gaussian-icdf")
RADEMACHER_STREAM_BIT = np.uint64(1 << 62)  # normal groups are < 2^62; SR sets bit 63
LOWRANK_KEY_A = 0x4C4F5752414E4B41  # "LOWRANKA"
LOWRANK_KEY_B = 0x4C4F5752414E4B42  # "LOWRANKB"
MAX_RANK = 1024


@dataclass(frozen=True)
class NoiseFamily:
    """A noise family: ``gaussian`` (spec v1), ``gaussian-icdf``, ``rademacher``, or ``lowrank:r`` (1 <= r <= 1024).

    ``NoiseFamily.parse("lowrank:4")``; ``str()`` gives the spec back.  Torch-free.
    """

    name: str = "gaussian"
    rank: int = 0

    @classmethod
    def parse(cls, spec) -> "NoiseFamily":
        if isinstance(spec, NoiseFamily):
            return spec
        if not isinstance(spec, str):
            raise TypeError(
                f"noise family must be a string such as 'gaussian', 'gaussian-icdf', 'rademacher' or 'lowrank:4', got {spec!r}"
            )
        name, _, arg = spec.strip().partition(":")
        if name in ("gaussian", "gaussian-icdf", "rademacher") and not _:
            return cls(name)
        if name == "lowrank" and _:
            if not arg.isdigit() or not 1 <= int(arg) <= MAX_RANK:
                raise ValueError(
                    f"noise family {spec!r}: the rank of lowrank:r must be an integer in [1, {MAX_RANK}], got {arg!r}"
                )
            return cls("lowrank", int(arg))
        raise ValueError(
            f"unknown noise family {spec!r}; known: 'gaussian', 'gaussian-icdf', 'rademacher', 'lowrank:r' "
            f"(r an integer in [1, {MAX_RANK}])"
        )

    def __str__(self) -> str:
        return f"lowrank:{self.rank}" if self.name == "lowrank" else self.name


def rademacher(seed: int, key: int, index) -> np.ndarray:
    """ε = ±1 (float32) of logical element(s) ``index`` (uint64): bit (i & 31) of word (i >> 5) & 3 of
    Philox call h = (i >> 7) | 2^62, same key and counter layout as the normals; bit 1 gives -1."""
    index = np.asarray(index, dtype=np.uint64)
    words = np.stack(philox_words(seed, key, (index >> np.uint64(7)) | RADEMACHER_STREAM_BIT), axis=-1)
    w = _lane(words, (index >> np.uint64(5)) & np.uint64(3))
    bit = (w >> (index & np.uint64(31)).astype(np.uint32)) & np.uint32(1)
    return np.where(bit == 1, _f(-1.0), _f(1.0)).astype(np.float32)


def lowrank_scale(rank: int) -> np.float32:
    """K_r = fl(1 / fl(sqrt(fl(r)))), the binary32 1/√r of lowrank:r."""
    return ONE / np.sqrt(_f(rank))


def lowrank(seed: int, key: int, index, logical_cols: int, rank: int) -> np.ndarray:
    """ε of lowrank:r at logical element(s) ``index`` of a logical [R, C] matrix (C = logical_cols):
    ε(a, b) = Σ_j fl(fl(K_r·A[a, j])·Bᵀ[j, b]), summed from +0 in j order, with A[a, j] = ε_v1(seed,
    key ^ LOWRANK_KEY_A, a·r + j) (a logical [R, r] matrix) and Bᵀ[j, b] = ε_v1(seed, key ^ LOWRANK_KEY_B,
    j·C + b) (a logical [r, C] matrix).  float32."""
    index = np.asarray(index, dtype=np.uint64)
    C, r = np.uint64(logical_cols), np.uint64(rank)
    a, b = index // C, index % C
    k = lowrank_scale(rank)
    t = np.zeros(index.shape, dtype=np.float32)
    for j in range(rank):
        aj = k * normal(seed, key ^ LOWRANK_KEY_A, a * r + np.uint64(j))
        bj = normal(seed, key ^ LOWRANK_KEY_B, np.uint64(j) * C + b)
        t = t + aj * bj
    return t


def family_noise(family, seed: int, key: int, index, logical_rows: int, logical_cols: int) -> np.ndarray:
    """ε of any family at logical element(s) ``index`` of a logical [logical_rows, logical_cols] parameter.
    lowrank on a parameter with one logical row (1-D: norms, biases) is the Gaussian (v1)."""
    fam = NoiseFamily.parse(family)
    if fam.name == "rademacher":
        return rademacher(seed, key, index)
    if fam.name == "gaussian-icdf":
        return normal_icdf(seed, key, index)
    if fam.name == "lowrank" and logical_rows > 1:
        return lowrank(seed, key, index, logical_cols, fam.rank)
    return normal(seed, key, index)


# ---- rounding from binary32 to the storage formats, by integer operations --------------------


#: the bits of a NaN the add creates (inf − inf), on every backend (docs/noise.md §3)
CANONICAL_NAN = 0x7FC00000


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even binary32 -> bfloat16 bits (uint16); any NaN gives the pinned 0x7FC0."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, np.uint32(CANONICAL_NAN >> 16), rounded).astype(np.uint16)


def bf16_bits_to_f32(h: np.ndarray) -> np.ndarray:
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def apply_update(center: np.ndarray, delta: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32(center) + delta back to ``dtype`` ('float32', 'float16', 'bfloat16' as uint16 bits).

    A NaN element of ``center`` keeps its own bits, and a NaN the add creates is the pinned
    :data:`CANONICAL_NAN` (fp16 0x7E00, bf16 0x7FC0) (docs/noise.md §3)."""
    with np.errstate(invalid="ignore", over="ignore"):
        if dtype == "bfloat16":
            nan = (np.asarray(center, dtype=np.uint16) & np.uint16(0x7FFF)) > np.uint16(0x7F80)
            return np.where(nan, center, f32_to_bf16_bits(bf16_bits_to_f32(center) + delta)).astype(np.uint16)
        if dtype == "float16":
            out = (center.astype(np.float32) + delta).astype(np.float16)  # numpy rounds to nearest even
            out = np.where(np.isnan(out), np.uint16(0x7E00).view(np.float16), out)
            return np.where(np.isnan(center), center, out)
        out = (center + delta).astype(np.float32)
        out = np.where(np.isnan(out), np.uint32(CANONICAL_NAN).view(np.float32), out)
        return np.where(np.isnan(center), center, out)


def perturb_reference(
    w: np.ndarray,
    dtype: str,
    seed: int,
    key: int,
    sigma: float,
    sign: int = 1,
    row_offset: int = 0,
    col_offset: int = 0,
    logical_cols: int | None = None,
    *,
    noise: str = "gaussian",
    logical_rows: int | None = None,
    scale: float = 1.0,
) -> np.ndarray:
    """Reference for ``espert.ops.perturb_``: w + c·ε with c = fl32(fl32(sign·σ)·scale), rounded once to ``dtype``."""
    return update_reference(
        w,
        dtype,
        [seed],
        [sign * sigma],
        key,
        row_offset,
        col_offset,
        logical_cols,
        noise=noise,
        logical_rows=logical_rows,
        scale=scale,
    )


def update_reference(
    w: np.ndarray,
    dtype: str,
    seeds,
    coeffs,
    key: int,
    row_offset: int = 0,
    col_offset: int = 0,
    logical_cols: int | None = None,
    *,
    noise: str = "gaussian",
    logical_rows: int | None = None,
    scale: float = 1.0,
) -> np.ndarray:
    """Reference for ``espert.ops.es_update_``: w + Σ_n c_n·ε_n, summed in float32 from +0 in member order,
    c_n = fl32(fl32(coeffs[n])·fl32(scale)).  ``noise``: a family spec (``NoiseFamily.parse``);
    ``logical_rows`` (default: the block's last row + 1) decides the lowrank 1-row fallback."""
    fam = NoiseFamily.parse(noise)
    idx = block_indices(w.shape, row_offset, col_offset, logical_cols)
    rows = 1 if len(w.shape) == 1 else int(np.prod(w.shape[:-1]))
    C = w.shape[-1] if logical_cols is None else logical_cols
    R = row_offset + rows if logical_rows is None else logical_rows
    acc = np.zeros(w.shape, dtype=np.float32)
    for s, c in zip(seeds, coeffs):
        acc = acc + (_f(c) * _f(scale)) * family_noise(fam, int(s), key, idx, R, C)
    return apply_update(w, acc, dtype)


def anchor_decay_reference(master: np.ndarray, anchor: np.ndarray, norm: str, amount: float) -> np.ndarray:
    """Reference for ``espert.ops.anchor_decay_`` (anchored weight decay, csrc/anchor.h): the new master.

    master, anchor: float32 arrays of one shape (the anchor's values widened exactly).  With d = m - a,
    l2: a + fl32(1 - amount)·d; l1: a where |d| - fl32(amount) is not > 0, else a + sign(d)·(|d| - p);
    every step a float32 operation; elements whose master or anchor is not finite are returned as they are."""
    m = np.asarray(master, dtype=np.float32)
    a = np.asarray(anchor, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        d = m - a
        if norm == "l2":
            r = a + np.float32(1.0 - amount) * d
        elif norm == "l1":
            s = np.abs(d) - np.float32(amount)
            moved = a + np.copysign(s, d)
            r = np.where(s > 0, moved, a)
        else:
            raise ValueError(f"unknown anchor norm {norm!r}")
    return np.where(np.isfinite(m) & np.isfinite(a), r, m).astype(np.float32)


# ---- golden vectors: committed in tests/golden/, regenerated only on a spec version bump ----

GOLDEN_CASES = [  # (seed, parameter name, first logical index, count)
    (0, "model.layers.0.self_attn.q_proj.weight", 0, 64),
    (1, "model.layers.0.self_attn.q_proj.weight", 1_000_003, 37),
    (2**64 - 1, "lm_head.weight", 2**40 + 5, 16),
    (0x0123456789ABCDEF, "", 2**63 - 8, 8),
]


def golden_vectors() -> dict:
    """Known-answer vectors of the spec: Philox words and normals (as float32 bit patterns)."""
    cases = []
    for seed, name, start, count in GOLDEN_CASES:
        key = param_key(name)
        idx = np.arange(count, dtype=np.uint64) + np.uint64(start)
        words = philox_words(seed, key, idx[:4] >> np.uint64(2))
        cases.append(
            {
                "seed": seed,
                "name": name,
                "key": key,
                "start": start,
                "philox_group0": [int(w[0]) for w in words],
                "normal_bits": [int(b) for b in normal(seed, key, idx).view(np.uint32)],
            }
        )
    return {"spec_version": SPEC_VERSION, "cases": cases}


# Every noise family (§5) on Blocks, 1-D and 2-D, and near the top of the index space: ε as float32 bits
# (what es_update_ with coefficient 1 writes into float32 zeros).  (family, seed, name, block) with block
# (rows, cols, row_offset, col_offset, logical_rows, logical_cols).
FAMILY_GOLDEN_BLOCKS = [
    (1, 40, 0, 0, 1, 40),  # 1-D: lowrank falls back to the Gaussian
    (3, 37, 5, 11, 20, 100),  # a shard of a 2-D matrix, rows starting mid Philox group
    (1, 24, 0, 2**64 - 26, 1, 2**64 - 1),  # 1-D, the last indices (the last valid index is 2^64 - 2)
    (2, 21, 2**32 - 3, 2**32 - 22, 2**32 - 1, 2**32 - 1),  # 2-D near 2^64 elements (lowrank rows ~ 2^32)
]
FAMILY_GOLDEN_FAMILIES = ["gaussian", "rademacher", "lowrank:1", "lowrank:2", "lowrank:4", "gaussian-icdf"]
FAMILY_GOLDEN_SEEDS = [(0, "model.layers.3.mlp.up_proj.weight"), (2**64 - 1, "lm_head.weight")]


def family_golden_vectors() -> dict:
    """Known-answer vectors of every noise family (tests/golden/families_v1.json)."""
    cases = []
    for fam in FAMILY_GOLDEN_FAMILIES:
        for i, (rows, cols, r0, c0, lr, lc) in enumerate(FAMILY_GOLDEN_BLOCKS):
            seed, name = FAMILY_GOLDEN_SEEDS[i % len(FAMILY_GOLDEN_SEEDS)]
            key = param_key(name)
            idx = block_indices((rows, cols), r0, c0, lc)
            eps = family_noise(fam, seed, key, idx, lr, lc).astype(np.float32)
            cases.append(
                {
                    "family": fam,
                    "seed": seed,
                    "name": name,
                    "key": key,
                    "block": [rows, cols, r0, c0, lr, lc],
                    "noise_hex": [f"{int(b):08x}" for b in eps.reshape(-1).view(np.uint32)],
                }
            )
    return {"spec_version": SPEC_VERSION, "cases": cases}


if __name__ == "__main__":
    # python -m espert.noise [families] > tests/golden/noise_v1.json (families_v1.json);
    # python -m espert.noise icdf-table rewrites espert/icdf_table.py and csrc/icdf_table.h from a new fit
    import json
    import sys
    from pathlib import Path

    if sys.argv[1:] == ["icdf-table"]:
        py, h = render_icdf_table(fit_icdf_table())
        root = Path(__file__).resolve().parents[1]
        (root / "espert" / "icdf_table.py").write_text(py)
        (root / "csrc" / "icdf_table.h").write_text(h)
    else:
        print(json.dumps(family_golden_vectors() if sys.argv[1:] == ["families"] else golden_vectors(), indent=1))
