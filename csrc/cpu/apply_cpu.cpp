// CPU kernel: tiles of 16 Philox groups (64 logical elements).  The per-lane math is
// noise.h inlined into a loop the compiler vectorizes; the same loop is compiled twice,
// for AVX-512 and for the baseline ISA, and the path is chosen at run time.
// Must be built with -ffp-contract=off (exactness depends on it) and -fno-math-errno (else
// sqrtf keeps an errno branch and the lane loop does not vectorize); see CMakeLists.txt.
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

template <int DT>
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
      const uint64_t seed = a.seeds[m];
      const float c = a.coeffs[m];
      alignas(64) float n0[kTileGroups], n1[kTileGroups], n2[kTileGroups], n3[kTileGroups];
#pragma GCC ivdep
      for (int j = 0; j < kTileGroups; ++j) {
        const F4 f = normals4(seed, a.key, g0 + (uint64_t)j);
        n0[j] = f.n0;
        n1[j] = f.n1;
        n2[j] = f.n2;
        n3[j] = f.n3;
      }
      for (int j = 0; j < kTileGroups; ++j) {
        acc[4 * j + 0] = fadd(acc[4 * j + 0], fmul(c, n0[j]));
        acc[4 * j + 1] = fadd(acc[4 * j + 1], fmul(c, n1[j]));
        acc[4 * j + 2] = fadd(acc[4 * j + 2], fmul(c, n2[j]));
        acc[4 * j + 3] = fadd(acc[4 * j + 3], fmul(c, n3[j]));
      }
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
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq"))) void run_avx512(const ApplyArgs& a, const Tiling& t,
                                                                              int64_t b, int64_t e) {
  run_tiles<DT>(a, t, b, e);
}

template <int DT>
void run_generic(const ApplyArgs& a, const Tiling& t, int64_t b, int64_t e) {
  run_tiles<DT>(a, t, b, e);
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

template <int DT>
void apply_typed(const ApplyArgs& a) {
  const Tiling tiling(a.block);
  const int64_t total = tiling.count();
  const bool avx = use_avx512();
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < (total + kTilesPerTask - 1) / kTilesPerTask; ++task) {
    const int64_t b = task * kTilesPerTask;
    const int64_t e = std::min(total, b + kTilesPerTask);
    if (avx) run_avx512<DT>(a, tiling, b, e);
    else run_generic<DT>(a, tiling, b, e);
  }
}

}  // namespace

const char* cpu_isa() { return use_avx512() ? "avx512" : "generic"; }

void apply_cpu(const ApplyArgs& a) {
  switch (a.dtype) {
    case kFloat32: apply_typed<kFloat32>(a); break;
    case kFloat16: apply_typed<kFloat16>(a); break;
    case kBFloat16: apply_typed<kBFloat16>(a); break;
  }
}

}  // namespace espert
