// The normal transform of the noise spec (docs/noise.md §2), hand-vectorized with AVX-512: 16 Philox
// groups at a time, bit-identical to the scalar neg2log_uniform / sincos_turn / normals4 of noise.h.
//
// Every float operation is the same single correctly rounded binary32 operation as in noise.h, in
// the same order: separate _mm512_mul_ps / _mm512_add_ps / _mm512_sub_ps / _mm512_div_ps /
// _mm512_sqrt_ps, never an FMA (an intrinsic is never contracted).  The bit tricks (exponent and
// mantissa split, quadrant reduction, sign flips) are integer operations; int -> float conversions
// are exact (|values| <= 2^24).  GCC's auto-vectorization of the scalar loop reached about half the
// speed of this (it spills the polynomial constants and blends through memory).
//
// Included by csrc/cpu/apply_cpu.cpp.  tests/test_noise_spec_simd.py also compiles it against the
// portable SIMDe implementation of these intrinsics (ESPERT_SIMDE defined), so its bits are checked
// exhaustively on machines without AVX-512 as well.
#pragma once

#include <cstdint>

#include "../noise.h"

#if defined(ESPERT_SIMDE)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define ESPERT_AVX512_FN inline
#define ESPERT_AVX512_ENTRY inline
#else
#include <immintrin.h>
#define ESPERT_AVX512_FN inline __attribute__((always_inline, target("avx512f,avx512vl,avx512bw,avx512dq")))
// not always_inline: its callers (templates without the target attribute) may not force-inline it;
// GCC still inlines it into the AVX-512 kernel, whose target matches
#define ESPERT_AVX512_ENTRY inline __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq")))
#endif

namespace espert {
namespace avx512 {

ESPERT_AVX512_FN __m512 f32(uint32_t bits) { return _mm512_castsi512_ps(_mm512_set1_epi32((int)bits)); }
ESPERT_AVX512_FN __m512i i32(uint32_t v) { return _mm512_set1_epi32((int)v); }

// sqrt(-2 ln u) for u = ((x >> 8) + 1) * 2^-24: noise.h neg2log_uniform followed by fsqrt.
ESPERT_AVX512_FN __m512 radius16(__m512i x) {
  const __m512i k = _mm512_add_epi32(_mm512_srli_epi32(x, 8), i32(1));      // 1 .. 2^24
  const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(k), f32(0x33800000u));  // * 2^-24, exact
  const __m512i b = _mm512_castps_si512(u);
  __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(b, 23), i32(127));
  __m512i mb = _mm512_or_si512(_mm512_and_si512(b, i32(0x007FFFFFu)), i32(0x3F800000u));
  // m > sqrt(2): halve it (both < 2^31, so the signed compare is the unsigned one)
  const __mmask16 big = _mm512_cmpgt_epi32_mask(mb, i32(0x3FB504F3u));
  mb = _mm512_mask_sub_epi32(mb, big, mb, i32(0x00800000u));
  e = _mm512_mask_add_epi32(e, big, e, i32(1));
  const __m512 m = _mm512_castsi512_ps(mb);
  const __m512 one = f32(0x3F800000u);
  const __m512 s = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one));
  const __m512 t = _mm512_mul_ps(s, s);
  __m512 q = f32(0x3DE38E39u);                               // 1/9
  q = _mm512_add_ps(_mm512_mul_ps(q, t), f32(0x3E124925u));  // 1/7
  q = _mm512_add_ps(_mm512_mul_ps(q, t), f32(0x3E4CCCCDu));  // 1/5
  q = _mm512_add_ps(_mm512_mul_ps(q, t), f32(0x3EAAAAABu));  // 1/3
  q = _mm512_mul_ps(q, t);
  const __m512 s2 = _mm512_mul_ps(s, f32(0x40000000u));  // 2 s
  const __m512 log_m = _mm512_add_ps(s2, _mm512_mul_ps(s2, q));
  const __m512 ef = _mm512_cvtepi32_ps(e);
  const __m512 ln_u = _mm512_add_ps(_mm512_mul_ps(ef, f32(0x3F317200u)),                         // LN2_HI
                                    _mm512_add_ps(_mm512_mul_ps(ef, f32(0x35BFBE8Eu)), log_m));  // LN2_LO
  return _mm512_sqrt_ps(_mm512_mul_ps(ln_u, f32(0xC0000000u)));                                  // * -2
}

// (cos θ, sin θ) for θ = 2π (y >> 8) / 2^24: noise.h sincos_turn.
ESPERT_AVX512_FN void sincos16(__m512i y, __m512& c_out, __m512& s_out) {
  const __m512i t = _mm512_srli_epi32(y, 8);                                 // 0 .. 2^24-1
  __m512i quad = _mm512_srli_epi32(_mm512_add_epi32(t, i32(1u << 21)), 22);  // 0 .. 4 (t >= 0)
  const __m512i r = _mm512_sub_epi32(t, _mm512_slli_epi32(quad, 22));        // -2^21 .. 2^21-1
  quad = _mm512_and_si512(quad, i32(3));
  const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(r), f32(0x34C90FDBu));  // 2π / 2^24
  const __m512 z = _mm512_mul_ps(a, a);
  __m512 p = f32(0x3638EF1Du);                               // 1/9!
  p = _mm512_add_ps(_mm512_mul_ps(p, z), f32(0xB9500D01u));  // -1/7!
  p = _mm512_add_ps(_mm512_mul_ps(p, z), f32(0x3C088889u));  // 1/5!
  p = _mm512_add_ps(_mm512_mul_ps(p, z), f32(0xBE2AAAABu));  // -1/3!
  const __m512 sin_a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_mul_ps(a, z), p));
  p = f32(0xB493F27Eu);                                      // -1/10!
  p = _mm512_add_ps(_mm512_mul_ps(p, z), f32(0x37D00D01u));  // 1/8!
  p = _mm512_add_ps(_mm512_mul_ps(p, z), f32(0xBAB60B61u));  // -1/6!
  p = _mm512_add_ps(_mm512_mul_ps(p, z), f32(0x3D2AAAABu));  // 1/4!
  p = _mm512_add_ps(_mm512_mul_ps(p, z), f32(0xBF000000u));  // -1/2!
  const __m512 cos_a = _mm512_add_ps(f32(0x3F800000u), _mm512_mul_ps(z, p));
  // rotate by quad quarter turns: swap on odd quadrants; negate c on 1, 2 and s on 2, 3 (sign bit)
  const __mmask16 swap = _mm512_test_epi32_mask(quad, i32(1));
  const __mmask16 neg_c = _mm512_test_epi32_mask(_mm512_add_epi32(quad, i32(1)), i32(2));
  const __mmask16 neg_s = _mm512_test_epi32_mask(quad, i32(2));
  const __m512i c = _mm512_castps_si512(_mm512_mask_blend_ps(swap, cos_a, sin_a));
  const __m512i s = _mm512_castps_si512(_mm512_mask_blend_ps(swap, sin_a, cos_a));
  c_out = _mm512_castsi512_ps(_mm512_mask_xor_epi32(c, neg_c, c, i32(0x80000000u)));
  s_out = _mm512_castsi512_ps(_mm512_mask_xor_epi32(s, neg_s, s, i32(0x80000000u)));
}

// n[4 j + l] = lane j of n_l: 4 x 16 -> 16 x 4, the element order of 16 groups' normals.
ESPERT_AVX512_FN void store_groups16(__m512 n0, __m512 n1, __m512 n2, __m512 n3, float* n) {
  // within each 128-bit lane L (groups 4L .. 4L+3):
  const __m512 lo01 = _mm512_unpacklo_ps(n0, n1), hi01 = _mm512_unpackhi_ps(n0, n1);
  const __m512 lo23 = _mm512_unpacklo_ps(n2, n3), hi23 = _mm512_unpackhi_ps(n2, n3);
  // g0: lane L holds group 4L's four normals; g1: group 4L+1; g2: 4L+2; g3: 4L+3
  const __m512 g0 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(lo01), _mm512_castps_pd(lo23)));
  const __m512 g1 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(lo01), _mm512_castps_pd(lo23)));
  const __m512 g2 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(hi01), _mm512_castps_pd(hi23)));
  const __m512 g3 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(hi01), _mm512_castps_pd(hi23)));
  // output vector k holds groups 4k .. 4k+3 = lane k of g0, g1, g2, g3: a 4 x 4 transpose of lanes
  const __m512 g01_lo = _mm512_shuffle_f32x4(g0, g1, 0x44), g23_lo = _mm512_shuffle_f32x4(g2, g3, 0x44);
  const __m512 g01_hi = _mm512_shuffle_f32x4(g0, g1, 0xEE), g23_hi = _mm512_shuffle_f32x4(g2, g3, 0xEE);
  _mm512_storeu_ps(n + 0, _mm512_shuffle_f32x4(g01_lo, g23_lo, 0x88));
  _mm512_storeu_ps(n + 16, _mm512_shuffle_f32x4(g01_lo, g23_lo, 0xDD));
  _mm512_storeu_ps(n + 32, _mm512_shuffle_f32x4(g01_hi, g23_hi, 0x88));
  _mm512_storeu_ps(n + 48, _mm512_shuffle_f32x4(g01_hi, g23_hi, 0xDD));
}

// gaussian-icdf's normal of each lane's word: noise.h icdf_normal (gathers for the table rows).
ESPERT_AVX512_FN __m512 icdf16(__m512i x) {
  const __m512i d = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(x, 1), i32(0x00FFFFFEu)), i32(1));
  const __m512i b = _mm512_castps_si512(_mm512_cvtepi32_ps(d));  // exact
  const __m512i j4 = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(b, 20), i32(1016)), 2);
  const __m512 y = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(b, i32(0x000FFFFFu)), i32(0x3F800000u)));
  const float* t = reinterpret_cast<const float*>(kIcdfTable);
  __m512 p = _mm512_fmadd_ps(_mm512_i32gather_ps(j4, t, 4), y, _mm512_i32gather_ps(j4, t + 1, 4));
  p = _mm512_fmadd_ps(p, y, _mm512_i32gather_ps(j4, t + 2, 4));
  p = _mm512_fmadd_ps(p, y, _mm512_i32gather_ps(j4, t + 3, 4));
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(p), _mm512_and_si512(x, i32(0x80000000u))));
}

// The 64 gaussian-icdf normals of 16 groups from their Philox words (x[w] lane j: word w of group j).
ESPERT_AVX512_ENTRY void icdf_tile16(const uint32_t (&x)[4][16], float (&n)[64]) {
  store_groups16(icdf16(_mm512_loadu_si512(x[0])), icdf16(_mm512_loadu_si512(x[1])), icdf16(_mm512_loadu_si512(x[2])),
                 icdf16(_mm512_loadu_si512(x[3])), n);
}

// The 64 normals of 16 consecutive groups from their Philox words x[w][j] (word w of group j), in
// element order: n[4 j + lane], lanes 0..3 = R0 cos θ1, R0 sin θ1, R2 cos θ3, R2 sin θ3 (noise.h normals4).
ESPERT_AVX512_ENTRY void normals_tile16(const uint32_t (&x)[4][16], float (&n)[64]) {
  const __m512 r0 = radius16(_mm512_loadu_si512(x[0]));
  const __m512 r1 = radius16(_mm512_loadu_si512(x[2]));
  __m512 c, s;
  sincos16(_mm512_loadu_si512(x[1]), c, s);
  const __m512 n0 = _mm512_mul_ps(r0, c), n1 = _mm512_mul_ps(r0, s);
  sincos16(_mm512_loadu_si512(x[3]), c, s);
  const __m512 n2 = _mm512_mul_ps(r1, c), n3 = _mm512_mul_ps(r1, s);
  store_groups16(n0, n1, n2, n3, n);
}

}  // namespace avx512
}  // namespace espert
