// CPU kernel: one OpenMP region over the tiles of every entry of a launch plan (all tensors of
// a call).  Tiles: gaussian and gaussian-icdf 16 Philox groups (64 logical elements), rademacher 8 Philox calls
// (1024 elements), lowrank 256 columns.  The per-lane math is noise.h inlined into loops the compiler
// vectorizes; the same loops are compiled three times, for AVX-512 and AVX2 (each with Philox and
// the normal transform written in intrinsics) and for the baseline ISA, and the path is chosen at
// run time.  All produce the same bits (tests/test_ops.py, tests/test_noise_spec_simd.py).
// Tile positions are computed in column space (int64), never as logical indices, so elements up to
// logical index 2^64 - 1 are reached.
// Must be built with -ffp-contract=off (exactness depends on it) and -fno-math-errno (else
// sqrtf keeps an errno branch and the lane loop does not vectorize); see CMakeLists.txt.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../apply.h"
#include "normals_avx2.h"
#include "normals_avx512.h"

namespace espert {
namespace {

constexpr int kTileGroups = 16;
constexpr int kTileElems = 4 * kTileGroups;
constexpr int64_t kTilesPerTask = 64;  // 4096 elements (gaussian) per OpenMP task
constexpr int kRadTileCalls = 8;       // rademacher tiles: 8 Philox calls of 128 elements
constexpr int kRadTileElems = 128 * kRadTileCalls;
constexpr int kLowRankCols = 256;  // lowrank tiles: 256 columns (no Philox: bigger tiles, less overhead)

// The instruction set a kernel instance is compiled for (chosen at run time, see apply_many_cpu).
enum Isa : int { kGenericIsa = 0, kAvx2Isa = 1, kAvx512Isa = 2 };

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

// The normals of one tile of normal family FAM, in element order: n[4 j + lane] for group g0 + j.
template <int FAM, int kIsa>
ESPERT_HD void tile_normals(uint64_t seed, uint64_t key, uint64_t g0, float (&n)[kTileElems]) {
  alignas(64) float n0[kTileGroups], n1[kTileGroups], n2[kTileGroups], n3[kTileGroups];
  if constexpr (kIsa == kAvx512Isa) {
    alignas(64) uint32_t x[4][16];
    philox_tile_avx512(seed, key, g0, x);
    if constexpr (FAM == kGaussianIcdf)
      avx512::icdf_tile16(x, n);
    else
      avx512::normals_tile16(x, n);  // the transform in intrinsics, already in element order
    return;
  } else if constexpr (kIsa == kAvx2Isa) {
    if constexpr (FAM == kGaussianIcdf)
      avx2::icdf_tile16(seed, key, g0, n);
    else
      avx2::normals_tile16(seed, key, g0, n);  // Philox and the transform in intrinsics, in element order
    return;
  } else {
#pragma GCC ivdep
    for (int j = 0; j < kTileGroups; ++j) {
      const F4 f = family_normals4<FAM>(seed, key, g0 + (uint64_t)j);
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

// Tiles per row of an entry: units of one tile's groups (lowrank: 4-column groups).
inline int64_t tiles_per_row(const PlanEntry& e) {
  const int64_t tile_groups = is_normal_family(e.family) ? kTileGroups
                              : e.family == kRademacher  ? 32 * kRadTileCalls
                                                         : kLowRankCols / 4;
  return units_per_row(e.family, e.cols, tile_groups);
}

constexpr int kMaxTileElems = kRadTileElems;  // the longest row segment a tile stores

// Stores acc[k - col0] into columns [cf, ce) of a row.  patch (a recording perturb): the elements the
// subtraction would not restore are listed, with one slot reservation per tile.
template <int DT>
ESPERT_HD void store_row(void* data, int64_t i, int64_t row_stride, int64_t col0, int64_t cf, int64_t ce,
                         const float* acc, const PatchList* patch) {
  using T = typename Storage<DT>::T;
  T* row = reinterpret_cast<T*>(data) + i * row_stride;
  if (!patch) {
#pragma GCC ivdep
    for (int64_t k = cf; k < ce; ++k) row[k] = add_to<DT>(row[k], acc[k - col0]);
    return;
  }
  // three loops that vectorize (the old values, the add, the check), then the few misses compacted
  const int64_t len = ce - cf;
  const float* a = acc + (cf - col0);
  T* seg = row + cf;
  T olds[kMaxTileElems];
  uint8_t bad[kMaxTileElems];
  std::memcpy(olds, seg, (size_t)len * sizeof(T));
#pragma GCC ivdep
  for (int64_t k = 0; k < len; ++k) seg[k] = add_to<DT>(olds[k], a[k]);
  int n = 0;
#pragma GCC ivdep
  for (int64_t k = 0; k < len; ++k) {
    bad[k] = subtraction_restores<DT>(olds[k], seg[k], a[k]) ? 0 : 1;
    n += bad[k];
  }
  if (n == 0) return;
  int64_t slot = reserve_records(*patch, n);
  for (int64_t k = 0; k < len; ++k)
    if (bad[k]) write_record<DT>(*patch, slot++, seg + k, olds[k]);
}

template <int DT, int FAM, int kIsa>
ESPERT_HD void normal_tile(const PlanEntry& e, int64_t i, int64_t tile, const uint64_t* seeds, const float* coeffs,
                           const PatchList* patch) {
  const Block b = e.block();
  const uint64_t base = b.row_base(i);
  const int64_t col0 = tile * kTileElems - (int64_t)(base & 3);  // column of the tile's first lane
  const int64_t cf = std::max<int64_t>(0, col0), ce = std::min<int64_t>(e.cols, col0 + kTileElems);
  if (cf >= ce) return;
  const uint64_t g0 = (base >> 2) + (uint64_t)tile * kTileGroups;
  const float scale = u2f((uint32_t)e.scale_bits);
  alignas(64) float acc[kTileElems];
  for (int k = 0; k < kTileElems; ++k) acc[k] = 0.0f;
  for (int64_t m = e.member_begin; m < e.member_end; ++m) {
    const float c = fmul(coeffs[m], scale);
    alignas(64) float n[kTileElems];
    tile_normals<FAM, kIsa>(seeds[m], e.key, g0, n);
    for (int k = 0; k < kTileElems; ++k) acc[k] = fadd(acc[k], fmul(c, n[k]));
  }
  store_row<DT>(reinterpret_cast<void*>(e.data), i, e.row_stride, col0, cf, ce, acc, patch);
}

template <int DT>
ESPERT_HD void rademacher_tile(const PlanEntry& e, int64_t i, int64_t tile, const uint64_t* seeds, const float* coeffs,
                               const PatchList* patch) {
  const Block b = e.block();
  const uint64_t base = b.row_base(i);
  const int64_t col0 = tile * kRadTileElems - (int64_t)(base & 127);
  const int64_t cf = std::max<int64_t>(0, col0), ce = std::min<int64_t>(e.cols, col0 + kRadTileElems);
  if (cf >= ce) return;
  const uint64_t h0 = (base >> 7) + (uint64_t)tile * kRadTileCalls;
  const float scale = u2f((uint32_t)e.scale_bits);
  alignas(64) float acc[kRadTileElems];
  for (int k = 0; k < kRadTileElems; ++k) acc[k] = 0.0f;
  for (int64_t m = e.member_begin; m < e.member_end; ++m) {
    const uint32_t c = f2u(fmul(coeffs[m], scale));
    alignas(64) uint32_t words[4][kRadTileCalls];
#pragma GCC ivdep
    for (int t = 0; t < kRadTileCalls; ++t) {  // the calls' Philox rounds vectorize across t
      const U4 x = rademacher_words(seeds[m], e.key, h0 + (uint64_t)t);
      words[0][t] = x.x0;
      words[1][t] = x.x1;
      words[2][t] = x.x2;
      words[3][t] = x.x3;
    }
    for (int t = 0; t < kRadTileCalls; ++t)
      for (int q = 0; q < 4; ++q) {
        const uint32_t wq = words[q][t];
        float* a = acc + 128 * t + 32 * q;
      // c · (±1) is c with its sign bit flipped by the element's bit: exact, and vectorizes
#pragma GCC ivdep
        for (int k = 0; k < 32; ++k) a[k] = fadd(a[k], u2f(c ^ (((wq >> k) & 1u) << 31)));
      }
  }
  store_row<DT>(reinterpret_cast<void*>(e.data), i, e.row_stride, col0, cf, ce, acc, patch);
}

template <int DT>
ESPERT_HD void lowrank_tile(const PlanEntry& e, int64_t i, int64_t tile, const float* coeffs, const PatchList* patch) {
  const int64_t col0 = tile * kLowRankCols;
  const int64_t len = std::min<int64_t>(kLowRankCols, e.cols - col0);
  const int64_t r = e.rank;
  const float scale = u2f((uint32_t)e.scale_bits);
  alignas(64) float acc[kLowRankCols];
  for (int k = 0; k < kLowRankCols; ++k) acc[k] = 0.0f;
  for (int64_t m = e.member_begin; m < e.member_end; ++m) {
    const float c = fmul(coeffs[m], scale);
    const int64_t mm = m - e.member_begin;
    const float* a = reinterpret_cast<const float*>(e.stage_a) + (mm * e.rows + i) * r;
    const float* bt = reinterpret_cast<const float*>(e.stage_b) + mm * r * e.cols + col0;
    alignas(64) float t[kLowRankCols];
    for (int k = 0; k < kLowRankCols; ++k) t[k] = 0.0f;
    for (int64_t j = 0; j < r; ++j) {
      const float aj = a[j];
      const float* bj = bt + j * e.cols;
#pragma GCC ivdep
      for (int64_t k = 0; k < len; ++k) t[k] = fadd(t[k], fmul(aj, bj[k]));
    }
    for (int k = 0; k < kLowRankCols; ++k) acc[k] = fadd(acc[k], fmul(c, t[k]));
  }
  store_row<DT>(reinterpret_cast<void*>(e.data), i, e.row_stride, col0, col0, col0 + len, acc, patch);
}

template <int DT, int FAM, int kIsa>
ESPERT_HD void run_entry_tiles(const PlanEntry& e, int64_t tpr, int64_t t_begin, int64_t t_end, const uint64_t* seeds,
                               const float* coeffs, const PatchList* patch) {
  int64_t i = t_begin / tpr, tile = t_begin % tpr;
  for (int64_t t = t_begin; t < t_end; ++t) {
    if constexpr (is_normal_family(FAM))
      normal_tile<DT, FAM, kIsa>(e, i, tile, seeds, coeffs, patch);
    else if constexpr (FAM == kRademacher)
      rademacher_tile<DT>(e, i, tile, seeds, coeffs, patch);
    else
      lowrank_tile<DT>(e, i, tile, coeffs, patch);
    if (++tile == tpr) {
      tile = 0;
      ++i;
    }
  }
}

template <int DT, int FAM>
ESPERT_AVX512 void run_avx512(const PlanEntry& e, int64_t tpr, int64_t b, int64_t end, const uint64_t* s,
                              const float* c, const PatchList* p) {
  run_entry_tiles<DT, FAM, kAvx512Isa>(e, tpr, b, end, s, c, p);
}

// For processors without AVX-512: the normal tiles in AVX2 intrinsics (normals_avx2.h), the other
// loops compiled for AVX2 (8 lanes instead of SSE2's 4).  The fma target serves gaussian-icdf's fused
// multiply-adds only: -ffp-contract=off forbids contracting any other multiply and add.
template <int DT, int FAM>
__attribute__((target("avx2,fma"))) void run_avx2(const PlanEntry& e, int64_t tpr, int64_t b, int64_t end,
                                                  const uint64_t* s, const float* c, const PatchList* p) {
  run_entry_tiles<DT, FAM, kAvx2Isa>(e, tpr, b, end, s, c, p);
}

template <int DT, int FAM>
void run_generic(const PlanEntry& e, int64_t tpr, int64_t b, int64_t end, const uint64_t* s, const float* c,
                 const PatchList* p) {
  run_entry_tiles<DT, FAM, kGenericIsa>(e, tpr, b, end, s, c, p);
}

// Tiles [b, end) of entry e, with its dtype and family as template arguments, on the ISA's path.  The
// dispatch lambdas stay outside the target("...") functions, so the tile loops keep their ISA.
void run_tiles(Isa isa, const PlanEntry& e, int64_t tpr, int64_t b, int64_t end, const uint64_t* s, const float* c,
               const PatchList* p) {
  DTYPE_SWITCH(e.dtype, DT, [&] {
    FAMILY_SWITCH(e.family, FAM, [&] {
      if (isa == kAvx512Isa)
        run_avx512<DT, FAM>(e, tpr, b, end, s, c, p);
      else if (isa == kAvx2Isa)
        run_avx2<DT, FAM>(e, tpr, b, end, s, c, p);
      else
        run_generic<DT, FAM>(e, tpr, b, end, s, c, p);
    });
  });
}

bool use_avx2() {
  static const bool yes = [] {
    const char* forced = std::getenv("ESPERT_CPU_ISA");
    if (forced && std::strcmp(forced, "generic") == 0) return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}

}  // namespace

const char* check_plan(const PlanEntry* plan, int64_t n_entries, int64_t n_members) {
  static thread_local std::string msg;
  for (int64_t k = 0; k < n_entries; ++k) {
    const PlanEntry& e = plan[k];
    const char* bad = nullptr;
    if (e.dtype < 0 || e.dtype >= kNumDTypes)
      bad = "unknown dtype code";
    else if (e.family < 0 || e.family >= kNumFamilies)
      bad = "unknown noise family code";
    else if (e.rows < 0 || e.cols < 0 || (e.rows > 1 && e.row_stride < e.cols))
      bad = "bad rows/cols/row_stride";
    else if (e.member_begin < 0 || e.member_end < e.member_begin || e.member_end > n_members)
      bad = "bad member range";
    else if (e.rows > 0 && e.cols > 0 && e.data == 0)
      bad = "null data pointer";
    else if (e.family == kLowRank && (e.rank < 1 || e.stage_a == 0 || e.stage_b == 0))
      bad = "lowrank needs rank >= 1 and staging";
    if (bad) {
      msg = std::string("espert launch plan entry ") + std::to_string(k) + ": " + bad + " (dtype " +
            std::to_string(e.dtype) + ", family " + std::to_string(e.family) + ")";
      return msg.c_str();
    }
  }
  return nullptr;
}

bool use_avx512() {
  static const bool yes = [] {
    const char* forced = std::getenv("ESPERT_CPU_ISA");
    if (forced && std::strcmp(forced, "generic") == 0) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}

const char* check_patch(const int64_t* records, int64_t n) {
  static thread_local std::string msg;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t dtype = records[2 * j + 1] >> 32;
    if (dtype < 0 || dtype >= kNumDTypes || records[2 * j] == 0) {
      msg = "espert patch record " + std::to_string(j) + ": unknown dtype code or null address";
      return msg.c_str();
    }
  }
  return nullptr;
}

void apply_patch_cpu(const int64_t* records, int64_t n) {
  if (const char* err = check_patch(records, n)) throw std::invalid_argument(err);
  for (int64_t j = 0; j < n; ++j) write_patch(records[2 * j], records[2 * j + 1]);
}

const char* cpu_isa() { return use_avx512() ? "avx512" : use_avx2() ? "avx2" : "generic"; }

void apply_many_cpu(const PlanEntry* plan, int64_t n_entries, const uint64_t* seeds, const float* coeffs,
                    int64_t n_members, const PatchList* patch) {
  if (const char* err = check_plan(plan, n_entries, n_members)) throw std::invalid_argument(err);
  // tile prefix over all entries: tasks of kTilesPerTask tiles may span entries
  std::vector<int64_t> start(n_entries + 1, 0), tpr(n_entries, 0);
  for (int64_t k = 0; k < n_entries; ++k) {
    const PlanEntry& e = plan[k];
    const bool empty = e.rows == 0 || e.cols == 0 || e.member_end == e.member_begin;
    tpr[k] = empty ? 1 : tiles_per_row(e);
    start[k + 1] = start[k] + (empty ? 0 : e.rows * tpr[k]);
  }
  const int64_t total = start[n_entries];
  const int64_t ntasks = (total + kTilesPerTask - 1) / kTilesPerTask;
  const Isa isa = use_avx512() ? kAvx512Isa : use_avx2() ? kAvx2Isa : kGenericIsa;
  // one thread team for the whole call; a team costs more than a few tasks (tiny calls, busy machines)
#pragma omp parallel for schedule(dynamic, 1) if (ntasks >= 4)
  for (int64_t task = 0; task < ntasks; ++task) {
    int64_t b = task * kTilesPerTask;
    const int64_t end = std::min(total, b + kTilesPerTask);
    int64_t k = std::upper_bound(start.begin(), start.end(), b) - start.begin() - 1;
    while (b < end) {
      while (start[k + 1] <= b) ++k;  // skip empty entries
      const int64_t e_end = std::min(end, start[k + 1]);
      run_tiles(isa, plan[k], tpr[k], b - start[k], e_end - start[k], seeds, coeffs, patch);
      b = e_end;
    }
  }
}

}  // namespace espert
