// CPU kernel for quantized weights: OpenMP over tiles of units (csrc/quant.h), 64 Philox groups per
// tile.  The noise of a tile is computed in a loop over its groups that the compiler vectorizes
// (the groups' counters are computed, not contiguous); then each element is edited in its storage
// word.  Compiled for AVX-512 and for the baseline ISA, chosen at run time like apply_cpu.cpp.
// Needs -ffp-contract=off and -fno-math-errno (CMakeLists.txt).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "../apply.h"
#include "../quant.h"

namespace espert {
namespace quant {
namespace {

constexpr int kTileGroups = 64;

// acc[l][j] += Σ_m c_m ε_m of lane l of group j, in member order, over a full tile (padding groups
// are computed, never used, so the loop stays vectorized)
template <int FAM>
ESPERT_HD void tile_members(const QuantArgs& a, const int64_t (&gn)[kTileGroups], const int64_t (&gk)[kTileGroups],
                            const uint64_t (&gg)[kTileGroups], float (&acc)[4][kTileGroups]) {
  for (int64_t m = 0; m < a.n; ++m) {
    const uint64_t seed = a.seeds[m];
    const float c = a.coeffs[m];
#pragma GCC ivdep
    for (int j = 0; j < kTileGroups; ++j) {
      const F4 f = member_noise4<FAM>(a, m, seed, gn[j], gk[j], gg[j]);
      acc[0][j] = fadd(acc[0][j], fmul(c, f.n0));
      acc[1][j] = fadd(acc[1][j], fmul(c, f.n1));
      acc[2][j] = fadd(acc[2][j], fmul(c, f.n2));
      acc[3][j] = fadd(acc[3][j], fmul(c, f.n3));
    }
  }
}

template <int E, int L, int MODE, int FAM>
ESPERT_HD void run_tiles(const QuantArgs& a, int64_t u_begin, int64_t u_end) {
  using Ly = Lay<L>;
  constexpr int G = Ly::G;
  constexpr int TU = kTileGroups / G;  // units per tile
  for (int64_t u0 = u_begin; u0 < u_end; u0 += TU) {
    const int nu = (int)std::min<int64_t>(TU, u_end - u0);
    const int ng = nu * G;
    alignas(64) int64_t gn[kTileGroups], gk[kTileGroups];
    alignas(64) uint64_t gg[kTileGroups];
    for (int j = 0; j < ng; ++j) {
      Ly::origin(u0 + j / G, j % G, a.N, a.K, gn[j], gk[j]);
      gg[j] = ((a.row_offset + (uint64_t)gn[j]) * a.logical_cols + a.col_offset + (uint64_t)gk[j]) >> 2;
    }
    // one scale per group: group sizes are multiples of 8 and k0 % 4 == 0, so the 4 lanes share it
    alignas(64) float sc[kTileGroups];
    for (int j = 0; j < ng; ++j) sc[j] = load_scale(a, gn[j], gk[j]);
    for (int j = ng; j < kTileGroups; ++j) {  // padding: a full tile keeps the loops vectorized
      gn[j] = gn[0];
      gk[j] = gk[0];
      gg[j] = gg[0];
    }
    alignas(64) float acc[4][kTileGroups];
    for (int l = 0; l < 4; ++l)
      for (int j = 0; j < kTileGroups; ++j) acc[l][j] = 0.0f;
    tile_members<FAM>(a, gn, gk, gg, acc);
    alignas(64) float us[4][kTileGroups];
    if (MODE == kPerturb) {
#pragma GCC ivdep
      for (int j = 0; j < kTileGroups; ++j) {
        const F4 f = sr_uniforms4(a.seeds[0], a.key, gg[j]);
        us[0][j] = f.n0;
        us[1][j] = f.n1;
        us[2][j] = f.n2;
        us[3][j] = f.n3;
      }
    }
    for (int j = 0; j < ng; ++j) {
      for (int l = 0; l < 4; ++l) {
        const int64_t n = gn[j], k = gk[j] + l;
        const Loc p = Ly::loc(n, k, a.ld);
        const float s = sc[j];
        const float u = MODE == kPerturb ? us[l][j] : 0.0f;
        float* mp = MODE == kUpdateMaster ? a.master + n * a.K + k : nullptr;
        if (E == kInt4) {
          uint32_t* w = reinterpret_cast<uint32_t*>(a.codes) + p.word;
          const uint32_t code = (*w >> p.shift) & 0xFu;
          const uint32_t nc = edit_code<E, MODE>(code, acc[l][j], s, u, mp, a.qmin, a.qmax);
          *w = (*w & ~(0xFu << p.shift)) | (nc << p.shift);
        } else {
          uint8_t* b = reinterpret_cast<uint8_t*>(a.codes) + p.word;
          *b = (uint8_t)edit_code<E, MODE>(*b, acc[l][j], s, u, mp, a.qmin, a.qmax);
        }
      }
    }
  }
}

template <int E, int L, int MODE, int FAM>
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq"))) void run_avx512(const QuantArgs& a, int64_t b,
                                                                              int64_t e) {
  run_tiles<E, L, MODE, FAM>(a, b, e);
}

template <int E, int L, int MODE, int FAM>
void run_generic(const QuantArgs& a, int64_t b, int64_t e) {
  run_tiles<E, L, MODE, FAM>(a, b, e);
}

template <int E, int L, int MODE, int FAM>
void run(const QuantArgs& a) {
  const int64_t units = Lay<L>::units(a.N, a.K);
  const int64_t per_task = 16 * (kTileGroups / Lay<L>::G);  // 16 tiles, 4096 elements
  const int64_t tasks = (units + per_task - 1) / per_task;
  const bool avx = espert::use_avx512();
#pragma omp parallel for schedule(static) if (tasks >= 4)  // a thread team costs more than a few tasks
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t b = t * per_task, e = std::min(units, b + per_task);
    if (avx)
      run_avx512<E, L, MODE, FAM>(a, b, e);
    else
      run_generic<E, L, MODE, FAM>(a, b, e);
  }
}

}  // namespace

void quant_cpu(const QuantArgs& a) {
  const std::string err = check_codes(a);
  if (!err.empty()) throw std::invalid_argument(err);
  QUANT_SWITCH(a, E, L, MODE, [&] { FAMILY_SWITCH(a.family, FAM, [&] { run<E, L, MODE, FAM>(a); }); });
}

}  // namespace quant
}  // namespace espert
