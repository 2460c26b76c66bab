// The noise spec's Philox4x32-10 and normal transform (docs/noise.md §2), hand-vectorized with AVX2:
// 8 Philox groups per vector, bit-identical to philox4x32_10 / neg2log_uniform / sincos_turn /
// normals4 of noise.h.  The same operations as normals_avx512.h, with AVX2's vector masks (all-ones
// lanes from compares, blendv) in place of mask registers.
//
// Every float operation is the same single correctly rounded binary32 operation as in noise.h, in
// the same order (separate mul/add/sub/div/sqrt intrinsics, never an FMA: an intrinsic is never
// contracted).  For processors without AVX-512: GCC's auto-vectorization of the scalar loop for the
// avx2 target ran at about a third of this speed.
//
// Included by csrc/cpu/apply_cpu.cpp; tests/test_noise_spec_simd.py checks it exhaustively against
// the scalar code (all 2^24 radius and angle inputs, and whole tiles from seeds).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../noise.h"

// the fma target only for gaussian-icdf's fused multiply-adds: -ffp-contract=off keeps every other mul and
// add separate (an intrinsic is never contracted)
#define ESPERT_AVX2_FN inline __attribute__((always_inline, target("avx2,fma")))
// not always_inline: its callers (templates without the target attribute) may not force-inline it;
// GCC still inlines it into the AVX2 kernel, whose target matches
#define ESPERT_AVX2_ENTRY inline __attribute__((target("avx2,fma")))

namespace espert {
namespace avx2 {

ESPERT_AVX2_FN __m256 f32(uint32_t bits) { return _mm256_castsi256_ps(_mm256_set1_epi32((int)bits)); }
ESPERT_AVX2_FN __m256i i32(uint32_t v) { return _mm256_set1_epi32((int)v); }

// 8 lanes of 32x32->64-bit products (m: the multiplier in the low half of each 64-bit lane).
ESPERT_AVX2_FN void mulhilo8(__m256i a, __m256i m, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(a, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

// Philox4x32-10 words of groups g0 .. g0+15: x[h][w] lane j = word w of group g0 + 8 h + j.  The two
// halves' rounds are interleaved: one Philox call is a chain of dependent multiplies, so a single
// chain leaves the multipliers idle half the time.
ESPERT_AVX2_FN void philox16(uint64_t seed, uint64_t key, uint64_t g0, __m256i (&x)[2][4]) {
  const __m256i flip = i32(0x80000000u);
  __m256i c[2][4];
  for (int h = 0; h < 2; ++h) {
    const uint64_t g = g0 + 8 * (uint64_t)h;
    const __m256i g_lo = i32((uint32_t)g);
    c[h][0] = _mm256_add_epi32(g_lo, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    // the low word wrapped (c0 < g_lo unsigned): carry into the high word; unsigned compare via the sign flip
    const __m256i wrapped = _mm256_cmpgt_epi32(_mm256_xor_si256(g_lo, flip), _mm256_xor_si256(c[h][0], flip));
    c[h][1] = _mm256_sub_epi32(i32((uint32_t)(g >> 32)), wrapped);  // wrapped lanes are -1
    c[h][2] = i32((uint32_t)key);
    c[h][3] = i32((uint32_t)(key >> 32));
  }
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  const __m256i m0 = _mm256_set1_epi64x(0xD2511F53u), m1 = _mm256_set1_epi64x(0xCD9E8D57u);
  for (int r = 0; r < 10; ++r) {
    const __m256i kk0 = i32(k0), kk1 = i32(k1);
    for (int h = 0; h < 2; ++h) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo8(c[h][0], m0, hi0, lo0);
      mulhilo8(c[h][2], m1, hi1, lo1);
      c[h][0] = _mm256_xor_si256(_mm256_xor_si256(hi1, c[h][1]), kk0);
      c[h][2] = _mm256_xor_si256(_mm256_xor_si256(hi0, c[h][3]), kk1);
      c[h][1] = lo1;
      c[h][3] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int h = 0; h < 2; ++h)
    for (int w = 0; w < 4; ++w) x[h][w] = c[h][w];
}

// sqrt(-2 ln u) for u = ((x >> 8) + 1) * 2^-24: noise.h neg2log_uniform followed by fsqrt.
ESPERT_AVX2_FN __m256 radius8(__m256i x) {
  const __m256i k = _mm256_add_epi32(_mm256_srli_epi32(x, 8), i32(1));      // 1 .. 2^24
  const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(k), f32(0x33800000u));  // * 2^-24, exact
  const __m256i b = _mm256_castps_si256(u);
  __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(b, 23), i32(127));
  __m256i mb = _mm256_or_si256(_mm256_and_si256(b, i32(0x007FFFFFu)), i32(0x3F800000u));
  // m > sqrt(2): halve it (both < 2^31, so the signed compare is the unsigned one); big lanes are -1
  const __m256i big = _mm256_cmpgt_epi32(mb, i32(0x3FB504F3u));
  mb = _mm256_sub_epi32(mb, _mm256_and_si256(big, i32(0x00800000u)));
  e = _mm256_sub_epi32(e, big);
  const __m256 m = _mm256_castsi256_ps(mb);
  const __m256 one = f32(0x3F800000u);
  const __m256 s = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one));
  const __m256 t = _mm256_mul_ps(s, s);
  __m256 q = f32(0x3DE38E39u);                               // 1/9
  q = _mm256_add_ps(_mm256_mul_ps(q, t), f32(0x3E124925u));  // 1/7
  q = _mm256_add_ps(_mm256_mul_ps(q, t), f32(0x3E4CCCCDu));  // 1/5
  q = _mm256_add_ps(_mm256_mul_ps(q, t), f32(0x3EAAAAABu));  // 1/3
  q = _mm256_mul_ps(q, t);
  const __m256 s2 = _mm256_mul_ps(s, f32(0x40000000u));  // 2 s
  const __m256 log_m = _mm256_add_ps(s2, _mm256_mul_ps(s2, q));
  const __m256 ef = _mm256_cvtepi32_ps(e);
  const __m256 ln_u = _mm256_add_ps(_mm256_mul_ps(ef, f32(0x3F317200u)),                         // LN2_HI
                                    _mm256_add_ps(_mm256_mul_ps(ef, f32(0x35BFBE8Eu)), log_m));  // LN2_LO
  return _mm256_sqrt_ps(_mm256_mul_ps(ln_u, f32(0xC0000000u)));                                  // * -2
}

// (cos θ, sin θ) for θ = 2π (y >> 8) / 2^24: noise.h sincos_turn.
ESPERT_AVX2_FN void sincos8(__m256i y, __m256& c_out, __m256& s_out) {
  const __m256i t = _mm256_srli_epi32(y, 8);                                 // 0 .. 2^24-1
  __m256i quad = _mm256_srli_epi32(_mm256_add_epi32(t, i32(1u << 21)), 22);  // 0 .. 4 (t >= 0)
  const __m256i r = _mm256_sub_epi32(t, _mm256_slli_epi32(quad, 22));        // -2^21 .. 2^21-1
  quad = _mm256_and_si256(quad, i32(3));
  const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(r), f32(0x34C90FDBu));  // 2π / 2^24
  const __m256 z = _mm256_mul_ps(a, a);
  __m256 p = f32(0x3638EF1Du);                               // 1/9!
  p = _mm256_add_ps(_mm256_mul_ps(p, z), f32(0xB9500D01u));  // -1/7!
  p = _mm256_add_ps(_mm256_mul_ps(p, z), f32(0x3C088889u));  // 1/5!
  p = _mm256_add_ps(_mm256_mul_ps(p, z), f32(0xBE2AAAABu));  // -1/3!
  const __m256 sin_a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_mul_ps(a, z), p));
  p = f32(0xB493F27Eu);                                      // -1/10!
  p = _mm256_add_ps(_mm256_mul_ps(p, z), f32(0x37D00D01u));  // 1/8!
  p = _mm256_add_ps(_mm256_mul_ps(p, z), f32(0xBAB60B61u));  // -1/6!
  p = _mm256_add_ps(_mm256_mul_ps(p, z), f32(0x3D2AAAABu));  // 1/4!
  p = _mm256_add_ps(_mm256_mul_ps(p, z), f32(0xBF000000u));  // -1/2!
  const __m256 cos_a = _mm256_add_ps(f32(0x3F800000u), _mm256_mul_ps(z, p));
  // rotate by quad quarter turns: swap on odd quadrants; negate c on 1, 2 and s on 2, 3 (sign bit)
  const __m256 swap = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(quad, i32(1)), i32(1)));
  const __m256i neg_c = _mm256_slli_epi32(_mm256_and_si256(_mm256_add_epi32(quad, i32(1)), i32(2)), 30);
  const __m256i neg_s = _mm256_slli_epi32(_mm256_and_si256(quad, i32(2)), 30);
  const __m256i c = _mm256_castps_si256(_mm256_blendv_ps(cos_a, sin_a, swap));
  const __m256i s = _mm256_castps_si256(_mm256_blendv_ps(sin_a, cos_a, swap));
  c_out = _mm256_castsi256_ps(_mm256_xor_si256(c, neg_c));
  s_out = _mm256_castsi256_ps(_mm256_xor_si256(s, neg_s));
}

// n[4 j + l] = lane j of n_l: 4 x 8 -> 8 x 4, the element order of 8 groups' normals.
ESPERT_AVX2_FN void store_groups8(__m256 n0, __m256 n1, __m256 n2, __m256 n3, float* n) {
  // within each 128-bit half H (groups 4H .. 4H+3):
  const __m256 lo01 = _mm256_unpacklo_ps(n0, n1), hi01 = _mm256_unpackhi_ps(n0, n1);
  const __m256 lo23 = _mm256_unpacklo_ps(n2, n3), hi23 = _mm256_unpackhi_ps(n2, n3);
  // ga: groups 0 and 4; gb: 1 and 5; gc: 2 and 6; gd: 3 and 7 (low half, high half)
  const __m256 ga = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(lo01), _mm256_castps_pd(lo23)));
  const __m256 gb = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(lo01), _mm256_castps_pd(lo23)));
  const __m256 gc = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(hi01), _mm256_castps_pd(hi23)));
  const __m256 gd = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(hi01), _mm256_castps_pd(hi23)));
  _mm256_storeu_ps(n + 0, _mm256_permute2f128_ps(ga, gb, 0x20));
  _mm256_storeu_ps(n + 8, _mm256_permute2f128_ps(gc, gd, 0x20));
  _mm256_storeu_ps(n + 16, _mm256_permute2f128_ps(ga, gb, 0x31));
  _mm256_storeu_ps(n + 24, _mm256_permute2f128_ps(gc, gd, 0x31));
}

// The 32 normals of 8 consecutive groups from their Philox words (x[w] lane j: word w of group j), in
// element order: n[4 j + lane], lanes 0..3 = R0 cos θ1, R0 sin θ1, R2 cos θ3, R2 sin θ3 (noise.h normals4).
ESPERT_AVX2_FN void normals8(const __m256i (&x)[4], float* n) {
  const __m256 r0 = radius8(x[0]), r1 = radius8(x[2]);
  __m256 c, s;
  sincos8(x[1], c, s);
  const __m256 n0 = _mm256_mul_ps(r0, c), n1 = _mm256_mul_ps(r0, s);
  sincos8(x[3], c, s);
  const __m256 n2 = _mm256_mul_ps(r1, c), n3 = _mm256_mul_ps(r1, s);
  store_groups8(n0, n1, n2, n3, n);
}

// gaussian-icdf's normal of each lane's word: noise.h icdf_normal (gathers for the table rows).
ESPERT_AVX2_FN __m256 icdf8(__m256i x) {
  const __m256i d = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(x, 1), i32(0x00FFFFFEu)), i32(1));
  const __m256i b = _mm256_castps_si256(_mm256_cvtepi32_ps(d));  // exact
  const __m256i j4 = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_srli_epi32(b, 20), i32(1016)), 2);
  const __m256 y = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(b, i32(0x000FFFFFu)), i32(0x3F800000u)));
  const float* t = reinterpret_cast<const float*>(kIcdfTable);
  __m256 p = _mm256_fmadd_ps(_mm256_i32gather_ps(t, j4, 4), y, _mm256_i32gather_ps(t + 1, j4, 4));
  p = _mm256_fmadd_ps(p, y, _mm256_i32gather_ps(t + 2, j4, 4));
  p = _mm256_fmadd_ps(p, y, _mm256_i32gather_ps(t + 3, j4, 4));
  return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(p), _mm256_and_si256(x, i32(0x80000000u))));
}

// The 64 gaussian-icdf normals of groups g0 .. g0+15 in element order (one CPU kernel tile).
ESPERT_AVX2_ENTRY void icdf_tile16(uint64_t seed, uint64_t key, uint64_t g0, float (&n)[64]) {
  __m256i x[2][4];
  philox16(seed, key, g0, x);
  for (int h = 0; h < 2; ++h) store_groups8(icdf8(x[h][0]), icdf8(x[h][1]), icdf8(x[h][2]), icdf8(x[h][3]), n + 32 * h);
}

// The 64 normals of groups g0 .. g0+15 in element order (one CPU kernel tile).
ESPERT_AVX2_ENTRY void normals_tile16(uint64_t seed, uint64_t key, uint64_t g0, float (&n)[64]) {
  __m256i x[2][4];
  philox16(seed, key, g0, x);
  normals8(x[0], n);
  normals8(x[1], n + 32);
}

}  // namespace avx2
}  // namespace espert
