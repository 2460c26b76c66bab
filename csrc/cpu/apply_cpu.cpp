// CPU kernel: tiles of 16 Philox groups (64 logical elements).  The per-lane math is
// noise.h inlined into a loop the compiler vectorizes; the same loop is compiled twice,
// for AVX-512 (with Philox written in intrinsics) and for the baseline ISA, and the path
// is chosen at run time.  Both produce the same bits (tests/test_ops.py).
// Must be built with -ffp-contract=off (exactness depends on it) and -fno-math-errno (else
// sqrtf keeps an errno branch and the lane loop does not vectorize); see CMakeLists.txt.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "../apply.h"

namespace espert {
namespace {

constexpr int kTileGroups = 16;
constexpr int kTileElems = 4 * kTileGroups;
constexpr int64_t kTilesPerTask = 64;  // 4096 elements per OpenMP task

// Geometry of the tiles of one block: tile t of row i starts at group first_group(i) + 16 t.
struct Tiling {
  const Block& b;
  int64_t tiles_per_row;
  explicit Tiling(const Block& blk) : b(blk) {
    // a row of `cols` elements starting anywhere inside a group spans at most (cols + 6) / 4 groups
    const int64_t groups = (blk.cols + 6) / 4;
    tiles_per_row = (groups + kTileGroups - 1) / kTileGroups;
  }
  int64_t count() const { return b.rows * tiles_per_row; }
};

#define ESPERT_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq")))

// 16 lanes of 32x32->64-bit products: even lanes directly, odd lanes shifted down, then blended.
ESPERT_AVX512 inline void mulhilo16(__m512i a, __m512i m, __m512i& hi, __m512i& lo) {
  const __m512i even = _mm512_mul_epu32(a, m);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
}

// Philox4x32-10 words of groups g0 .. g0+15 (GCC vectorizes the scalar version poorly: 2x slower).
ESPERT_AVX512 inline void philox_tile_avx512(uint64_t seed, uint64_t key, uint64_t g0, uint32_t (&x)[4][16]) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i g_lo = _mm512_set1_epi32((int)(uint32_t)g0);
  const __m512i g_hi = _mm512_set1_epi32((int)(uint32_t)(g0 >> 32));
  __m512i c0 = _mm512_add_epi32(g_lo, iota);
  const __mmask16 carry = _mm512_cmplt_epu32_mask(c0, g_lo);  // low word wrapped: carry into the high word
  __m512i c1 = _mm512_mask_add_epi32(g_hi, carry, g_hi, _mm512_set1_epi32(1));
  __m512i c2 = _mm512_set1_epi32((int)(uint32_t)key);
  __m512i c3 = _mm512_set1_epi32((int)(uint32_t)(key >> 32));
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  const __m512i m0 = _mm512_set1_epi64(0xD2511F53u), m1 = _mm512_set1_epi64(0xCD9E8D57u);
  for (int r = 0; r < 10; ++r) {
    __m512i hi0, lo0, hi1, lo1;
    mulhilo16(c0, m0, hi0, lo0);
    mulhilo16(c2, m1, hi1, lo1);
    c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32((int)k0));
    c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32((int)k1));
    c1 = lo1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  _mm512_storeu_si512(x[0], c0);
  _mm512_storeu_si512(x[1], c1);
  _mm512_storeu_si512(x[2], c2);
  _mm512_storeu_si512(x[3], c3);
}

// The normals of one tile, in element order: n[4 j + lane] for group g0 + j.
template <bool kAvx512>
ESPERT_HD void tile_normals(uint64_t seed, uint64_t key, uint64_t g0, float (&n)[kTileElems]) {
  alignas(64) float n0[kTileGroups], n1[kTileGroups], n2[kTileGroups], n3[kTileGroups];
  if constexpr (kAvx512) {
    alignas(64) uint32_t x[4][16];
    philox_tile_avx512(seed, key, g0, x);
#pragma GCC ivdep
    for (int j = 0; j < kTileGroups; ++j) {
      const float r0 = fsqrt(neg2log_uniform(x[0][j]));
      const float r1 = fsqrt(neg2log_uniform(x[2][j]));
      float c, s;
      sincos_turn(x[1][j], c, s);
      n0[j] = fmul(r0, c);
      n1[j] = fmul(r0, s);
      sincos_turn(x[3][j], c, s);
      n2[j] = fmul(r1, c);
      n3[j] = fmul(r1, s);
    }
  } else {
#pragma GCC ivdep
    for (int j = 0; j < kTileGroups; ++j) {
      const F4 f = normals4(seed, key, g0 + (uint64_t)j);
      n0[j] = f.n0;
      n1[j] = f.n1;
      n2[j] = f.n2;
      n3[j] = f.n3;
    }
  }
  for (int j = 0; j < kTileGroups; ++j) {
    n[4 * j + 0] = n0[j];
    n[4 * j + 1] = n1[j];
    n[4 * j + 2] = n2[j];
    n[4 * j + 3] = n3[j];
  }
}

template <int DT, bool kAvx512>
ESPERT_HD void run_tiles(const ApplyArgs& a, const Tiling& tiling, int64_t t_begin, int64_t t_end) {
  using S = Storage<DT>;
  using T = typename S::T;
  const Block& b = a.block;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t i = t / tiling.tiles_per_row;
    const int64_t tile = t % tiling.tiles_per_row;
    const uint64_t base = b.row_base(i);
    const uint64_t g0 = (base >> 2) + (uint64_t)tile * kTileGroups;
    const uint64_t e_first = std::max<uint64_t>(base, 4 * g0);
    const uint64_t e_end = std::min<uint64_t>(base + (uint64_t)b.cols, 4 * g0 + kTileElems);
    if (e_first >= e_end) continue;

    alignas(64) float acc[kTileElems];
    for (int k = 0; k < kTileElems; ++k) acc[k] = 0.0f;
    for (int64_t m = 0; m < a.n; ++m) {
      const float c = a.coeffs[m];
      alignas(64) float n[kTileElems];
      tile_normals<kAvx512>(a.seeds[m], a.key, g0, n);
      for (int k = 0; k < kTileElems; ++k) acc[k] = fadd(acc[k], fmul(c, n[k]));
    }
    T* row = reinterpret_cast<T*>(a.data) + i * b.row_stride;
    T* w = row + (int64_t)(e_first - base);
    const float* d = acc + (e_first - 4 * g0);
    const int64_t len = (int64_t)(e_end - e_first);
#pragma GCC ivdep
    for (int64_t k = 0; k < len; ++k) w[k] = S::store(fadd(S::load(w[k]), d[k]));
  }
}

template <int DT>
ESPERT_AVX512 void run_avx512(const ApplyArgs& a, const Tiling& t, int64_t b, int64_t e) {
  run_tiles<DT, true>(a, t, b, e);
}

template <int DT>
void run_generic(const ApplyArgs& a, const Tiling& t, int64_t b, int64_t e) {
  run_tiles<DT, false>(a, t, b, e);
}

template <int DT>
void apply_typed(const ApplyArgs& a) {
  const Tiling tiling(a.block);
  const int64_t total = tiling.count();
  const bool avx = use_avx512();
  const int64_t ntasks = (total + kTilesPerTask - 1) / kTilesPerTask;
  // a thread team costs more than a few tasks of work (tiny tensors, busy machines)
#pragma omp parallel for schedule(static) if (ntasks >= 4)
  for (int64_t task = 0; task < ntasks; ++task) {
    const int64_t b = task * kTilesPerTask;
    const int64_t e = std::min(total, b + kTilesPerTask);
    if (avx) run_avx512<DT>(a, tiling, b, e);
    else run_generic<DT>(a, tiling, b, e);
  }
}

}  // namespace

bool use_avx512() {
  static const bool yes = [] {
    const char* forced = std::getenv("ESPERT_CPU_ISA");
    if (forced && std::strcmp(forced, "generic") == 0) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}

const char* cpu_isa() { return use_avx512() ? "avx512" : "generic"; }

void apply_cpu(const ApplyArgs& a) {
  switch (a.dtype) {
    case kFloat32: apply_typed<kFloat32>(a); break;
    case kFloat16: apply_typed<kFloat16>(a); break;
    case kBFloat16: apply_typed<kBFloat16>(a); break;
  }
}

}  // namespace espert
