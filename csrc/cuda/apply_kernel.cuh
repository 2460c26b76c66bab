// The body of the CUDA perturb/update kernel (apply_cuda.cu launches it).  A launch unit is row i of an
// entry and kCudaUnitGroups = 1024 consecutive groups of 4 elements; the block finds its entry by binary
// search over unit_start and its row by one divide (per group there is no 64-bit divide).
// - Gaussian and gaussian-icdf: a block of 128 threads owns a unit, 8 groups per thread strided by 128, so
//   warps stay coalesced (block_unit); lowrank: a block of 256 threads, 4 groups per thread.
// - Rademacher: a warp owns a unit and shares each Philox call across its lanes (rademacher_unit).
// Units (or chunks) wholly inside the row at a vector-aligned address run code of their own with one
// 8- or 16-byte __ldcs/__stcs per group and no bounds checks: the hot path that tests/test_sass_budget.py
// counts.  The rest (row ends, unaligned rows) checks every group and element (add_group).
//
// Included by nvcc (apply_cuda.cu) and, through host_shim.h, by a host C++ compiler: the emulated CUDA
// backend of tests/test_cuda_emulated.py runs this exact body block by block and thread by thread on
// the CPU, with the launch shape of launch_units() and launch_blocks() below, so CPU CI sees the
// kernel's indexing.
#pragma once

#include "../apply.h"

namespace espert {
namespace cuda_kernel {

constexpr int kThreads = 256;

// Threads that share one launch unit: a warp for Rademacher (rademacher_unit); 128 for the normal families,
// so a thread's 8 groups share each member's seed load and key schedule (a tenth of gaussian-icdf's hot
// path with 4 groups; v1 perturb 71.44 -> 69.78 instructions per element); lowrank: the block, 4 groups
// per thread.
__host__ __device__ constexpr int unit_threads(int family) {
  return family == kRademacher ? 32 : is_normal_family(family) ? 128 : kThreads;
}
// Threads per block: a normal family's block is its unit of 128 threads (84-94 registers: 5 blocks, 20
// warps, per SM).
__host__ __device__ constexpr int block_threads(int family) { return is_normal_family(family) ? 128 : kThreads; }
__host__ __device__ constexpr int groups_per_thread(int family) { return kCudaUnitGroups / unit_threads(family); }

template <int DT>
struct Vec4;
template <>
struct Vec4<kFloat32> {
  using V = float4;
  static __device__ __forceinline__ void split(const V& v, float (&x)[4]) {
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  }
  static __device__ __forceinline__ V join(const float (&x)[4]) { return make_float4(x[0], x[1], x[2], x[3]); }
};
template <>
struct Vec4<kFloat16> {
  using V = uint2;  // four 16-bit words
  static __device__ __forceinline__ void split(const V& v, uint16_t (&x)[4]) {
    x[0] = (uint16_t)v.x;
    x[1] = (uint16_t)(v.x >> 16);
    x[2] = (uint16_t)v.y;
    x[3] = (uint16_t)(v.y >> 16);
  }
  static __device__ __forceinline__ V join(const uint16_t (&x)[4]) {
    return make_uint2((uint32_t)x[0] | ((uint32_t)x[1] << 16), (uint32_t)x[2] | ((uint32_t)x[3] << 16));
  }
};
template <>
struct Vec4<kBFloat16> : Vec4<kFloat16> {};

// p[0..3] = round(p[l] + acc[l]) through one vector load and store (p aligned to the vector, inside the row).
template <int DT>
__device__ __forceinline__ void add_vec4(typename Storage<DT>::T* p, const float (&acc)[4]) {
  using T = typename Storage<DT>::T;
  using V = typename Vec4<DT>::V;
  T x[4];
  Vec4<DT>::split(__ldcs(reinterpret_cast<const V*>(p)), x);  // LDG.E.64/.128, streaming
#pragma unroll
  for (int l = 0; l < 4; ++l) x[l] = add_to<DT>(x[l], acc[l]);
  __stcs(reinterpret_cast<V*>(p), Vec4<DT>::join(x));
}

// bf16: add_to<kBFloat16> with each element kept in the high half of a 32-bit word (its float32 bits, the
// rounding done there), so one byte permute packs two results: the same bits, fewer instructions.
__device__ __forceinline__ uint32_t bf16_add_high(uint32_t w_high, float d) {
  const float x = u2f(w_high), y = fadd(x, d);
  const uint32_t out = is_nan(y) ? kCanonicalNaN : bf16_round_high(f2u(y));
  return is_nan(x) ? w_high : out;  // a NaN element keeps its bits
}
template <>
__device__ __forceinline__ void add_vec4<kBFloat16>(uint16_t* p, const float (&acc)[4]) {
  const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
  const uint32_t a0 = bf16_add_high(v.x << 16, acc[0]), a1 = bf16_add_high(v.x & 0xFFFF0000u, acc[1]);
  const uint32_t a2 = bf16_add_high(v.y << 16, acc[2]), a3 = bf16_add_high(v.y & 0xFFFF0000u, acc[3]);
  __stcs(reinterpret_cast<uint2*>(p), make_uint2(__byte_perm(a0, a1, 0x7632), __byte_perm(a2, a3, 0x7632)));
}

// A recording perturb (restore="patch", apply.h PatchList): the elements of a group that subtraction would not
// restore, listed with one slot reservation for the group (a few percent of groups have any).
template <int DT>
__device__ __forceinline__ void record_misses(const PatchList& patch, typename Storage<DT>::T* p,
                                              const typename Storage<DT>::T (&old)[4],
                                              const typename Storage<DT>::T (&now)[4], const float (&acc)[4],
                                              const bool (&live)[4]) {
  bool miss[4];
  int n = 0;
#pragma unroll
  for (int l = 0; l < 4; ++l) {
    miss[l] = live[l] && !subtraction_restores<DT>(old[l], now[l], acc[l]);
    n += miss[l] ? 1 : 0;
  }
  if (n == 0) return;
  int64_t slot = reserve_records(patch, n);
#pragma unroll
  for (int l = 0; l < 4; ++l)
    if (miss[l]) write_record<DT>(patch, slot++, p + l, old[l]);
}

// add_vec4, and with kRecord the elements subtraction would not restore listed (the generic vector path).
template <int DT, bool kRecord>
__device__ __forceinline__ void store_vec4(typename Storage<DT>::T* p, const float (&acc)[4], const PatchList& patch) {
  if constexpr (!kRecord) {
    add_vec4<DT>(p, acc);
  } else {
    using T = typename Storage<DT>::T;
    using V = typename Vec4<DT>::V;
    T old[4], now[4];
    Vec4<DT>::split(__ldcs(reinterpret_cast<const V*>(p)), old);
#pragma unroll
    for (int l = 0; l < 4; ++l) now[l] = add_to<DT>(old[l], acc[l]);
    __stcs(reinterpret_cast<V*>(p), Vec4<DT>::join(now));
    const bool live[4] = {true, true, true, true};
    record_misses<DT>(patch, p, old, now, acc, live);
  }
}

// Σ over the entry's members of c_eff · ε for the four lanes of one group (normal families, lowrank).
template <int FAM>
__device__ __forceinline__ void group_sum(const PlanEntry& e, int64_t i, uint64_t g, int64_t c0,
                                          const uint64_t* __restrict__ seeds, const float* __restrict__ coeffs,
                                          float (&acc)[4]) {
  const float scale = u2f((uint32_t)e.scale_bits);
  acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
  for (int64_t m = e.member_begin; m < e.member_end; ++m) {
    const float c = fmul(coeffs[m], scale);
    if constexpr (is_normal_family(FAM)) {
      add_normals(acc, c, family_normals4<FAM>(seeds[m], e.key, g));
    } else {
      const int64_t mm = m - e.member_begin, r = e.rank;
      const float* a = reinterpret_cast<const float*>(e.stage_a) + (mm * e.rows + i) * r;
      const float* bt = reinterpret_cast<const float*>(e.stage_b) + mm * r * e.cols;
      float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int64_t j = 0; j < r; ++j) {
        const float aj = a[j];
        const float* bj = bt + j * e.cols;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
          const int64_t col = c0 + l;
          const float b = (col < e.cols) ? bj[col] : 0.0f;
          t[l] = fadd(t[l], fmul(aj, b));
        }
      }
#pragma unroll
      for (int l = 0; l < 4; ++l) acc[l] = fadd(acc[l], fmul(c, t[l]));
    }
  }
}

// The entry, row and chunk of launch unit u: the last entry whose unit_start <= u (binary search), then
// one divide.
__device__ __forceinline__ const PlanEntry* find_unit(const PlanEntry* __restrict__ plan, int64_t n_entries, int64_t u,
                                                      int64_t& i, int64_t& chunk) {
  int64_t lo = 0, hi = n_entries - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (plan[mid].unit_start <= u)
      lo = mid;
    else
      hi = mid - 1;
  }
  const PlanEntry* e = plan + lo;
  const int64_t local = u - e->unit_start;
  i = local / e->units_per_row;
  chunk = local - i * e->units_per_row;
  return e;
}

// The row-end path of add_group, element by element in a loop that is not unrolled (a row has at most
// two such groups; unrolled, its copies would be most of the hot loop's code).  acc[l] by selects: an
// indexed register array would go through local memory.
template <int DT, bool kRecord>
__device__ __forceinline__ void add_group_tail(typename Storage<DT>::T* row, int64_t c0, int64_t cols,
                                               const float (&acc)[4], const PatchList& patch) {
#pragma unroll 1
  for (int l = 0; l < 4; ++l) {
    const float a = l == 0 ? acc[0] : l == 1 ? acc[1] : l == 2 ? acc[2] : acc[3];
    if (c0 + l >= 0 && c0 + l < cols) {
      const typename Storage<DT>::T old = row[c0 + l], now = add_to<DT>(old, a);
      row[c0 + l] = now;
      if constexpr (kRecord)
        if (!subtraction_restores<DT>(old, now, a))
          write_record<DT>(patch, reserve_records(patch, 1), row + c0 + l, old);
    }
  }
}

// w[c0 .. c0+3] += acc, the columns of the row that exist: one vector load and store where the four are
// inside the row and aligned, else add_group_tail.
template <int DT, bool kRecord>
__device__ __forceinline__ void add_group(typename Storage<DT>::T* row, int64_t c0, int64_t cols, const float (&acc)[4],
                                          const PatchList& patch) {
  using T = typename Storage<DT>::T;
  using V = typename Vec4<DT>::V;
  T* p = row + c0;
  if (c0 >= 0 && c0 + 4 <= cols && (reinterpret_cast<uintptr_t>(p) % sizeof(V)) == 0) {
    store_vec4<DT, kRecord>(p, acc, patch);
  } else {
    add_group_tail<DT, kRecord>(row, c0, cols, acc, patch);
  }
}

// A value held by another lane of the warp: on the device a shuffle of this lane's `mine`; on the host
// (the emulated backend runs one thread at a time) the value lane `src` would hold, word_of(src).  Every
// lane of the warp must call it together.
template <class F>
__device__ __forceinline__ uint32_t from_lane(uint32_t mine, int src, const F& word_of) {
#if defined(__CUDA_ARCH__)
  (void)word_of;
  return __shfl_sync(0xFFFFFFFFu, mine, src);
#else
  (void)mine;
  return word_of(src);
#endif
}
template <class F>
__device__ __forceinline__ uint32_t own_word(const F& word_of, int lane) {
#if defined(__CUDA_ARCH__)
  return word_of(lane);
#else
  (void)word_of;
  (void)lane;
  return 0u;  // unused: from_lane recomputes the source lane's word
#endif
}

// acc[k][l] = the entry's sum over its members, in member order from +0, of what add(acc, seed, c)
// adds for each member (c = fl(coefficient · scale)): the loop both multi-group hot paths share.
template <int K, class F>
__device__ __forceinline__ void sum_members(const PlanEntry& e, const uint64_t* __restrict__ seeds,
                                            const float* __restrict__ coeffs, float (&acc)[K][4], const F& add) {
  const float scale = u2f((uint32_t)e.scale_bits);
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k][0] = acc[k][1] = acc[k][2] = acc[k][3] = 0.0f;
#pragma unroll 1
  for (int64_t m = e.member_begin; m < e.member_end; ++m) add(acc, seeds[m], fmul(coeffs[m], scale));
}

// Rademacher: one warp owns one unit (kCudaUnitGroups = 1024 groups = 32 Philox calls of 128 elements,
// the row's groups counted from a call boundary, so shift < 128).  The unit is 4 chunks of 8 calls; at
// step s of a chunk the warp covers the 128 elements of call s, lane l its group l (bits 4(l & 7) ..
// +3 of word l >> 3).  Lane 8k + j computes call j of the chunk and keeps word k: 8 calls, each by 4
// lanes, per 32 elements of a thread (one group per thread computed a whole call per 4 elements), and
// each step takes its word from lane 8(l >> 3) + s by one shuffle.
constexpr int kRadSteps = 8, kRadChunks = kCudaUnitGroups / (32 * kRadSteps);

// One chunk: Σ over the members, then the 8 groups of this lane added to the row.  kInterior: the whole
// chunk lies inside the row at a vector-aligned address (the warp decides it together), so every group
// takes the vector path with no bounds check; else add_group decides per group.
template <int DT, bool kInterior, bool kRecord>
__device__ __forceinline__ void rademacher_chunk(const PlanEntry& e, typename Storage<DT>::T* row, int64_t first,
                                                 uint64_t call, const uint64_t* __restrict__ seeds,
                                                 const float* __restrict__ coeffs, const PatchList& patch) {
  using T = typename Storage<DT>::T;
  const int lane = (int)(threadIdx.x & 31u);
  float acc[kRadSteps][4];
  sum_members(e, seeds, coeffs, acc, [&](float (&a)[kRadSteps][4], uint64_t seed, float c) {
    const uint32_t cb = f2u(c);
    const auto word_of = [&](int l) { return u4_word(rademacher_words(seed, e.key, call + (l & 7)), l >> 3); };
    const uint32_t mine = own_word(word_of, lane);
#pragma unroll
    for (int s = 0; s < kRadSteps; ++s) {
      const uint32_t wd = from_lane(mine, (lane & ~7) | s, word_of) >> (4 * (lane & 7));
#pragma unroll
      for (int l = 0; l < 4; ++l) a[s][l] = fadd(a[s][l], u2f(cb ^ (((wd >> l) & 1u) << 31)));
    }
  });
#pragma unroll
  for (int s = 0; s < kRadSteps; ++s) {
    const int64_t c0 = first + 4 * (32 * s + lane);
    if constexpr (kInterior) {
      T* p = row + c0;
      store_vec4<DT, kRecord>(p, acc[s], patch);
    } else if (c0 < e.cols) {
      add_group<DT, kRecord>(row, c0, e.cols, acc[s], patch);
    }
  }
}

template <int DT, bool kRecord>
__device__ __forceinline__ void rademacher_unit(const PlanEntry& e, int64_t i, int64_t chunk,
                                                const uint64_t* __restrict__ seeds, const float* __restrict__ coeffs,
                                                const PatchList& patch) {
  using T = typename Storage<DT>::T;
  using V = typename Vec4<DT>::V;
  constexpr int64_t kSpan = 4 * 32 * kRadSteps;  // elements of a chunk
  const uint64_t base = e.block().row_base(i);
  const int64_t shift = (int64_t)(base & 127);
  const uint64_t call0 = (base >> 7) + (uint64_t)chunk * (kCudaUnitGroups / 32);
  T* row = reinterpret_cast<T*>(e.data) + i * e.row_stride;
  const int64_t first0 = 4 * chunk * kCudaUnitGroups - shift;  // column of the unit's first element
  // chunks [lo, hi) lie inside the row; all chunks share the alignment of row + first0 (kSpan elements apart)
  const bool aligned = reinterpret_cast<uintptr_t>(row + first0) % sizeof(V) == 0;
  int64_t lo = first0 >= 0 ? 0 : 1;  // shift < 128 < kSpan: only chunk 0 can start before the row
  int64_t hi = (e.cols - first0) / kSpan;
  hi = !aligned ? 0 : hi < kRadChunks ? hi : kRadChunks;
  lo = lo < hi ? lo : hi;
#pragma unroll 1
  for (int64_t r = lo; r < hi; ++r)  // the hot loop: whole chunks, vector accesses only
    rademacher_chunk<DT, true, kRecord>(e, row, first0 + kSpan * r, call0 + kRadSteps * r, seeds, coeffs, patch);
#pragma unroll 1
  for (int64_t r = 0; r < kRadChunks; ++r) {  // the rest: the row's ends, or every chunk of an unaligned row
    if (r == lo) r = hi;
    if (r >= kRadChunks || first0 + kSpan * r >= e.cols) break;  // the same for the whole warp
    rademacher_chunk<DT, false, kRecord>(e, row, first0 + kSpan * r, call0 + kRadSteps * r, seeds, coeffs, patch);
  }
}

// Launch units per block: a normal family's or lowrank's unit is a block, a Rademacher unit a warp.
__host__ __device__ constexpr int64_t units_per_block(int family) {
  return block_threads(family) / unit_threads(family);
}

// A unit of a normal family or lowrank: groups_per_thread groups per thread, strided by unit_threads.  kInterior: the
// block found the whole unit inside the row and aligned, so every group takes the vector path with no bounds check (the
// hot loop); else add_group decides per group (row ends, unaligned rows).
template <int DT, int FAM, bool kInterior, bool kRecord>
__device__ __forceinline__ void block_unit(const PlanEntry& e, int64_t i, int64_t chunk, uint64_t base, int64_t shift,
                                           typename Storage<DT>::T* row, const uint64_t* __restrict__ seeds,
                                           const float* __restrict__ coeffs, const PatchList& patch) {
  using T = typename Storage<DT>::T;
  constexpr int kUnitThreads = unit_threads(FAM), kGroupsPerThread = groups_per_thread(FAM);
  const int64_t t = (int64_t)(threadIdx.x % kUnitThreads);  // this thread within the unit
  if constexpr (kInterior && is_normal_family(FAM)) {
    // the hot loop with the members outside: one seed and coefficient load per member for the thread's
    // 4 groups, whose 4 Philox calls share the key schedule (the sums keep member order per element)
    const int64_t q0 = chunk * kCudaUnitGroups + t;
    const uint64_t g0 = (base >> 2) + (uint64_t)q0;
    float acc[kGroupsPerThread][4];
    sum_members(e, seeds, coeffs, acc, [&](float (&a)[kGroupsPerThread][4], uint64_t seed, float c) {
#pragma unroll
      for (int s = 0; s < kGroupsPerThread; ++s)
        add_normals(a[s], c, family_normals4<FAM>(seed, e.key, g0 + (uint64_t)(s * kUnitThreads)));
    });
#pragma unroll
    for (int s = 0; s < kGroupsPerThread; ++s) {
      T* p = row + 4 * (q0 + s * kUnitThreads) - shift;
      store_vec4<DT, kRecord>(p, acc[s], patch);
    }
    return;
  }
#pragma unroll 1
  for (int s = 0; s < kGroupsPerThread; ++s) {
    const int64_t q = chunk * kCudaUnitGroups + s * kUnitThreads + t;
    const int64_t c0 = 4 * q - shift;
    if (!kInterior && c0 >= e.cols) break;
    float acc[4];
    group_sum<FAM>(e, i, (base >> 2) + (uint64_t)q, c0, seeds, coeffs, acc);
    if constexpr (kInterior) {
      T* p = row + c0;
      store_vec4<DT, kRecord>(p, acc, patch);
    } else {
      add_group<DT, kRecord>(row, c0, e.cols, acc, patch);
    }
  }
}

// kRecord: a recording perturb (restore="patch"), its list in `patch`; the plain kernels never read it.
template <int DT, int FAM, bool kRecord = false>
__global__ void apply_kernel(const PlanEntry* __restrict__ plan, int64_t n_entries, int64_t total_units,
                             const uint64_t* __restrict__ seeds, const float* __restrict__ coeffs,
                             const PatchList patch) {
  using T = typename Storage<DT>::T;
  constexpr int64_t kPerBlock = units_per_block(FAM);
  const int64_t within = kPerBlock == 1 ? 0 : (int64_t)(threadIdx.x / unit_threads(FAM));
  for (int64_t u = (int64_t)blockIdx.x * kPerBlock + within; u < total_units; u += (int64_t)gridDim.x * kPerBlock) {
    int64_t i, chunk;
    const PlanEntry& e = *find_unit(plan, n_entries, u, i, chunk);
    if constexpr (FAM == kRademacher) {
      rademacher_unit<DT, kRecord>(e, i, chunk, seeds, coeffs, patch);
    } else {
      const uint64_t base = e.block().row_base(i);
      // lowrank groups start at column 0; Gaussian groups are aligned to logical index 4g
      const int64_t shift = FAM == kLowRank ? 0 : (int64_t)(base & 3);
      T* row = reinterpret_cast<T*>(e.data) + i * e.row_stride;
      const int64_t first = 4 * chunk * kCudaUnitGroups - shift;  // column of the unit's first element
      // the whole unit inside the row at a vector-aligned address: the same for every thread of the block
      const bool interior = first >= 0 && first + 4 * kCudaUnitGroups <= e.cols &&
                            reinterpret_cast<uintptr_t>(row + first) % sizeof(typename Vec4<DT>::V) == 0;
      if (interior)
        block_unit<DT, FAM, true, kRecord>(e, i, chunk, base, shift, row, seeds, coeffs, patch);
      else
        block_unit<DT, FAM, false, kRecord>(e, i, chunk, base, shift, row, seeds, coeffs, patch);
    }
  }
}

// The grid of one launch over entries [0, n_entries) of a host plan: their common dtype and family, and
// the number of units.  False when the entries do not share a dtype and family or a units_per_row is
// not this kernel's (espert/ops groups and fills them).  Blocks: launch_blocks (grid-stride beyond).
inline bool launch_units(const PlanEntry* host_plan, int64_t n_entries, int& dtype, int& family, int64_t& units) {
  dtype = (int)host_plan[0].dtype;
  family = (int)host_plan[0].family;
  units = 0;
  for (int64_t k = 0; k < n_entries; ++k) {
    const PlanEntry& e = host_plan[k];
    if (e.dtype != dtype || e.family != family) return false;
    if (e.units_per_row != units_per_row(e.family, e.cols, kCudaUnitGroups)) return false;
    units = e.unit_start + e.rows * e.units_per_row > units ? e.unit_start + e.rows * e.units_per_row : units;
  }
  return true;
}
constexpr int64_t kMaxBlocks = (int64_t)1 << 30;
// Blocks of a launch of `units` units of `family`: enough for one unit each, at most kMaxBlocks.
inline int64_t launch_blocks(int family, int64_t units) {
  const int64_t b = (units + units_per_block(family) - 1) / units_per_block(family);
  return b < kMaxBlocks ? b : kMaxBlocks;
}

// Writes records [0, n) of a patch list back: one thread per record (grid-stride).
__global__ void patch_kernel(const int64_t* __restrict__ records, int64_t n) {
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (int64_t)gridDim.x * blockDim.x)
    write_patch(records[2 * j], records[2 * j + 1]);
}

}  // namespace cuda_kernel
}  // namespace espert
