// The noise spec's per-element math, shared by the CPU and CUDA kernels.
//
// Mirrors espert/noise.py operation for operation; docs/noise.md is the spec in
// words.  Every float operation is one correctly rounded binary32 operation:
// on the host this file must be compiled with -ffp-contract=off (no FMA
// contraction) and without -ffast-math; on the device the __f*_rn intrinsics
// are never contracted.  Torch-free on purpose: it is included by plain C++ and
// by nvcc alike.
#pragma once

#include <cstdint>
#include <cstring>

#include "icdf_table.h"

#if defined(__CUDACC__)
#define ESPERT_HD __host__ __device__ __forceinline__
#define ESPERT_UNROLL _Pragma("unroll")
#else
#define ESPERT_HD inline __attribute__((always_inline))
// fully unrolled loops let GCC vectorize the caller's loop over lanes
#define ESPERT_UNROLL _Pragma("GCC unroll 16")
#endif

namespace espert {

// ---- correctly rounded binary32 arithmetic, never contracted ---------------
#if defined(__CUDA_ARCH__)
ESPERT_HD float fadd(float a, float b) { return __fadd_rn(a, b); }
ESPERT_HD float fsub(float a, float b) { return __fsub_rn(a, b); }
ESPERT_HD float fmul(float a, float b) { return __fmul_rn(a, b); }
ESPERT_HD float fdiv(float a, float b) { return __fdiv_rn(a, b); }
ESPERT_HD float fsqrt(float a) { return __fsqrt_rn(a); }
// the one fused multiply-add (gaussian-icdf's), tagged: tests/test_cuda_ptx.py refuses any untagged fma
ESPERT_HD float ffma(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3; // espert ffma" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}
ESPERT_HD uint32_t f2u(float f) { return __float_as_uint(f); }
ESPERT_HD float u2f(uint32_t u) { return __uint_as_float(u); }
#else
ESPERT_HD float fadd(float a, float b) { return a + b; }
ESPERT_HD float fsub(float a, float b) { return a - b; }
ESPERT_HD float fmul(float a, float b) { return a * b; }
ESPERT_HD float fdiv(float a, float b) { return a / b; }
ESPERT_HD float fsqrt(float a) { return __builtin_sqrtf(a); }
// IEEE fused multiply-add, rounded once (an FMA instruction where the target has one, else libm's fmaf)
ESPERT_HD float ffma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
ESPERT_HD uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
ESPERT_HD float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
#endif

// ---- Philox4x32-10 ----------------------------------------------------------
struct U4 {
  uint32_t x0, x1, x2, x3;
};

// The high and low words of the 64-bit product a·b.  On the device __umulhi and a 32-bit multiply
// (IMAD.HI + IMAD) instead of a 64-bit multiply: the same bits, fewer instructions (SASS-counted).
ESPERT_HD uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t& lo) {
  lo = a * b;
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return (uint32_t)(((uint64_t)a * b) >> 32);
#endif
}

ESPERT_HD U4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  ESPERT_UNROLL
  for (int r = 0; r < 10; ++r) {
    uint32_t lo0, lo1;
    const uint32_t hi0 = mulhilo(0xD2511F53u, c0, lo0);
    const uint32_t hi1 = mulhilo(0xCD9E8D57u, c2, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c1 = lo1;
    c3 = lo0;
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return U4{c0, c1, c2, c3};
}

// The spec's Philox call for a 64-bit counter c (docs/noise.md §1): counter (lo(c), hi(c), lo(key), hi(key)),
// key (lo(seed), hi(seed)).  Every stream (normals, Rademacher, stochastic rounding) is one of these.
ESPERT_HD U4 philox_call(uint64_t seed, uint64_t key, uint64_t c) {
  return philox4x32_10((uint32_t)c, (uint32_t)(c >> 32), (uint32_t)key, (uint32_t)(key >> 32), (uint32_t)seed,
                       (uint32_t)(seed >> 32));
}

// ---- the normal transform ---------------------------------------------------
// -2 ln u for u = ((x >> 8) + 1) * 2^-24.
ESPERT_HD float neg2log_uniform(uint32_t x) {
  const float u = fmul((float)((x >> 8) + 1u), u2f(0x33800000u));  // * 2^-24, exact
  const uint32_t b = f2u(u);
  int32_t e = (int32_t)(b >> 23) - 127;
  uint32_t mb = (b & 0x007FFFFFu) | 0x3F800000u;
  const bool big = mb > 0x3FB504F3u;  // m > sqrt(2): halve it
  mb = big ? mb - 0x00800000u : mb;
  e = big ? e + 1 : e;
  const float m = u2f(mb);
  const float s = fdiv(fsub(m, 1.0f), fadd(m, 1.0f));
  const float t = fmul(s, s);
  float q = u2f(0x3DE38E39u);              // 1/9
  q = fadd(fmul(q, t), u2f(0x3E124925u));  // 1/7
  q = fadd(fmul(q, t), u2f(0x3E4CCCCDu));  // 1/5
  q = fadd(fmul(q, t), u2f(0x3EAAAAABu));  // 1/3
  q = fmul(q, t);
  const float s2 = fmul(s, 2.0f);
  const float log_m = fadd(s2, fmul(s2, q));
  const float ef = (float)e;
  const float ln_u = fadd(fmul(ef, u2f(0x3F317200u)), fadd(fmul(ef, u2f(0x35BFBE8Eu)), log_m));
  return fmul(ln_u, -2.0f);
}

// (cos θ, sin θ) for θ = 2π (y >> 8) / 2^24, with exact reduction to the nearest quarter turn.
ESPERT_HD void sincos_turn(uint32_t y, float& c_out, float& s_out) {
  const int32_t t = (int32_t)(y >> 8);
  int32_t quad = (t + (1 << 21)) >> 22;
  const int32_t r = t - (quad << 22);
  quad &= 3;
  const float a = fmul((float)r, u2f(0x34C90FDBu));  // 2π / 2^24
  const float z = fmul(a, a);
  float p = u2f(0x3638EF1Du);              // 1/9!
  p = fadd(fmul(p, z), u2f(0xB9500D01u));  // -1/7!
  p = fadd(fmul(p, z), u2f(0x3C088889u));  // 1/5!
  p = fadd(fmul(p, z), u2f(0xBE2AAAABu));  // -1/3!
  const float sin_a = fadd(a, fmul(fmul(a, z), p));
  p = u2f(0xB493F27Eu);                    // -1/10!
  p = fadd(fmul(p, z), u2f(0x37D00D01u));  // 1/8!
  p = fadd(fmul(p, z), u2f(0xBAB60B61u));  // -1/6!
  p = fadd(fmul(p, z), u2f(0x3D2AAAABu));  // 1/4!
  p = fadd(fmul(p, z), -0.5f);             // -1/2!
  const float cos_a = fadd(1.0f, fmul(z, p));
  const bool swap = (quad & 1) != 0;
  float c = swap ? sin_a : cos_a;
  float s = swap ? cos_a : sin_a;
  // negation is exact: flip the sign bit
  c = ((quad == 1) | (quad == 2)) ? -c : c;
  s = (quad >= 2) ? -s : s;
  c_out = c;
  s_out = s;
}

struct F4 {
  float n0, n1, n2, n3;
};

// The four normals of group g (logical elements 4g .. 4g+3) for (seed, key).
ESPERT_HD F4 normals4(uint64_t seed, uint64_t key, uint64_t g) {
  const U4 x = philox_call(seed, key, g);
  F4 out;
  const float r0 = fsqrt(neg2log_uniform(x.x0));
  const float r1 = fsqrt(neg2log_uniform(x.x2));
  float c, s;
  sincos_turn(x.x1, c, s);
  out.n0 = fmul(r0, c);
  out.n1 = fmul(r0, s);
  sincos_turn(x.x3, c, s);
  out.n2 = fmul(r1, c);
  out.n3 = fmul(r1, s);
  return out;
}

// ---- gaussian-icdf (docs/noise.md §5.4): one normal per Philox word ----------------------------
// |ε| ≈ Φ⁻¹(1 - d 2^-25) for d = 2 (x & 0x7FFFFF) + 1: the cubic of table row j at y in [1, 2), three
// fused multiply-adds; the sign is bit 31 of x.  The binade and top 3 mantissa bits of float(d) pick
// the row, its other 20 mantissa bits are y's.  Rows are (c3, c2, c1, c0).
constexpr int kIcdfRows = 192;

// (a & kMask) | c.  On the device one LOP3 with c in a register: ptxas otherwise spends two LOP3s, one
// per immediate.  0xEA is PTX's lookup table of (a & b) | c (tests/test_noise_spec_icdf.py derives it).
template <uint32_t kMask>
ESPERT_HD uint32_t and_or(uint32_t a, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(kMask), "r"(c));
  return r;
#else
  return (a & kMask) | c;
#endif
}
alignas(16) static constexpr uint32_t kIcdfTable[kIcdfRows][4] = {ESPERT_ICDF_TABLE};
#if defined(__CUDACC__)
static __device__ const uint4 kIcdfTableDevice[kIcdfRows] = {ESPERT_ICDF_TABLE};  // one LDG.128 per row
#endif

ESPERT_HD float icdf_normal(uint32_t x) {
  const uint32_t d = and_or<0x00FFFFFEu>(x << 1, 1u);  // 2 (x & 0x7FFFFF) + 1: odd, 1 .. 2^24 - 1
  const uint32_t b = f2u((float)(int32_t)d);           // exact
  const uint32_t j = (b >> 20) - 1016u;                // 0 .. 191
  const float y = u2f(and_or<0x000FFFFFu>(b, 0x3F800000u));
#if defined(__CUDA_ARCH__)
  const uint4 c = __ldg(&kIcdfTableDevice[j]);
  const uint32_t c3 = c.x, c2 = c.y, c1 = c.z, c0 = c.w;
#else
  const uint32_t c3 = kIcdfTable[j][0], c2 = kIcdfTable[j][1], c1 = kIcdfTable[j][2], c0 = kIcdfTable[j][3];
#endif
  const float p = ffma(ffma(ffma(u2f(c3), y, u2f(c2)), y, u2f(c1)), y, u2f(c0));
  return u2f(f2u(p) ^ (x & 0x80000000u));
}

// The four gaussian-icdf normals of group g: the transform of each word of the v1 normals' Philox call.
ESPERT_HD F4 icdf_normals4(uint64_t seed, uint64_t key, uint64_t g) {
  const U4 x = philox_call(seed, key, g);
  return F4{icdf_normal(x.x0), icdf_normal(x.x1), icdf_normal(x.x2), icdf_normal(x.x3)};
}

// acc[l] = fl(acc[l] + fl(c · n_l)) for the four normals of a group: one member's term of the spec's sum.
ESPERT_HD void add_normals(float (&acc)[4], float c, const F4& f) {
  acc[0] = fadd(acc[0], fmul(c, f.n0));
  acc[1] = fadd(acc[1], fmul(c, f.n1));
  acc[2] = fadd(acc[2], fmul(c, f.n2));
  acc[3] = fadd(acc[3], fmul(c, f.n3));
}

// ---- noise families (docs/noise.md §5) ---------------------------------------
// rademacher: element i is ±1 from bit (i & 31) of word (i >> 5) & 3 of the Philox call with
// group h = (i >> 7) | 2^62 (bit 1 -> -1).  Normal groups are i >> 2 < 2^62 and the stochastic-rounding
// stream sets bit 63, so the three streams never share a counter.
constexpr uint64_t kRademacherStream = 1ull << 62;
ESPERT_HD U4 rademacher_words(uint64_t seed, uint64_t key, uint64_t h) {
  return philox_call(seed, key, h | kRademacherStream);
}
ESPERT_HD uint32_t u4_word(const U4& x, int w) { return w == 0 ? x.x0 : w == 1 ? x.x1 : w == 2 ? x.x2 : x.x3; }

// lowrank:r: A is the v1 Gaussian of a logical [R, r] matrix under key ^ kLowRankKeyA, Bᵀ that of a
// logical [r, C] matrix under key ^ kLowRankKeyB ("LOWRANKA", "LOWRANKB" in ASCII), and
// ε(a, b) = Σ_j fl(fl(K_r · A[a, j]) · Bᵀ[j, b]) summed from +0 in j order, K_r = fl(1 / fl(sqrt(r))).
constexpr uint64_t kLowRankKeyA = 0x4C4F5752414E4B41ull;
constexpr uint64_t kLowRankKeyB = 0x4C4F5752414E4B42ull;
ESPERT_HD float lowrank_scale(int64_t r) { return fdiv(1.0f, fsqrt((float)r)); }

#if defined(__CUDA_ARCH__)
ESPERT_HD bool is_nan(float x) { return isnan(x); }  // one FSETP.NAN instead of a mask and a compare
#else
ESPERT_HD bool is_nan(float x) { return (f2u(x) & 0x7FFFFFFFu) > 0x7F800000u; }  // immune to -ffast-math
#endif

// The bits of a NaN that an add creates (inf - inf), pinned for every backend (docs/noise.md §3): x86
// would give 0xFFC00000 and a CUDA add 0x7FFFFFFF.  Narrowed: bf16 0x7FC0, fp16 0x7E00.
constexpr uint32_t kCanonicalNaN = 0x7FC00000u;

// ---- storage formats: exact widening, round-to-nearest-even narrowing -------
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

ESPERT_HD float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

// binary32 bits b rounded to nearest even at bit 16: the bf16 result is the high half (NaNs aside).
ESPERT_HD uint32_t bf16_round_high(uint32_t b) { return b + 0x7FFFu + ((b >> 16) & 1u); }

ESPERT_HD uint16_t f32_to_bf16(float f) {
  const uint32_t rounded = bf16_round_high(f2u(f)) >> 16;
  const bool nan = is_nan(f);
  return (uint16_t)(nan ? (kCanonicalNaN >> 16) : rounded);  // any NaN: the pinned one
}

ESPERT_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t ex = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (ex == 0x1Fu) return u2f(sign | 0x7F800000u | (man << 13));      // inf / nan
  if (ex != 0) return u2f(sign | ((ex + 112u) << 23) | (man << 13));  // normal
  // zero or subnormal: man * 2^-24, exact in binary32
  const float mag = fmul((float)man, u2f(0x33800000u));
  return u2f(sign | f2u(mag));
}

ESPERT_HD uint16_t f32_to_f16(float f) {
  const uint32_t b = f2u(f);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return (uint16_t)0x7E00u;            // any NaN: the pinned one (kCanonicalNaN)
  if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  // rounds to >= 65520: inf
  if (a >= 0x38800000u) {                // normal half: rebias and round the 13 dropped bits to nearest even
    const uint32_t v = a - 0x38000000u;  // exponent 127 -> 15
    return (uint16_t)(sign | ((v + 0xFFFu + ((v >> 13) & 1u)) >> 13));
  }
  // subnormal half (or zero): shift the full significand right, round to nearest even
  const uint32_t e = a >> 23;
  if (e < 102u) return (uint16_t)sign;  // below half of the smallest subnormal: rounds to 0
  const uint32_t man = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14 .. 24
  const uint32_t half = 1u << (shift - 1);
  const uint32_t rem = man & ((1u << shift) - 1u);
  uint32_t q = man >> shift;
  q += (rem > half || (rem == half && (q & 1u))) ? 1u : 0u;
  return (uint16_t)(sign | q);
}

template <int DT>
struct Storage;
template <>
struct Storage<kFloat32> {
  using T = float;
  static ESPERT_HD float load(float v) { return v; }
  static ESPERT_HD float store(float v) { return is_nan(v) ? u2f(kCanonicalNaN) : v; }
};
template <>
struct Storage<kFloat16> {
  using T = uint16_t;
  static ESPERT_HD float load(uint16_t v) { return f16_to_f32(v); }
  static ESPERT_HD uint16_t store(float v) { return f32_to_f16(v); }
};
template <>
struct Storage<kBFloat16> {
  using T = uint16_t;
  static ESPERT_HD float load(uint16_t v) { return bf16_to_f32(v); }
  static ESPERT_HD uint16_t store(float v) { return f32_to_bf16(v); }
};

// w + d rounded to the storage format; a NaN element keeps its own bits (exact restore needs them,
// and a hardware add would quiet or canonicalize the NaN), and a NaN the add creates is kCanonicalNaN
// (the stores above pin it).
template <int DT>
ESPERT_HD typename Storage<DT>::T add_to(typename Storage<DT>::T w, float d) {
  const float x = Storage<DT>::load(w);
  const typename Storage<DT>::T out = Storage<DT>::store(fadd(x, d));
  return is_nan(x) ? w : out;
}

// A 2-D block [rows, cols] (row stride `row_stride` elements, unit column stride) inside a
// logical [R, logical_cols] tensor, starting at (row_offset, col_offset).
// Logical coordinates are unsigned 64-bit: a logical index may be anywhere in [0, 2^64).
struct Block {
  int64_t rows, cols, row_stride;
  uint64_t row_offset, col_offset, logical_cols;
  ESPERT_HD uint64_t row_base(int64_t i) const { return (row_offset + (uint64_t)i) * logical_cols + col_offset; }
};

}  // namespace espert
