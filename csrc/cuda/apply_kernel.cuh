// The body of the CUDA perturb/update kernel (apply_cuda.cu launches it).  A block of 256 threads owns
// one unit: row i of an entry and kCudaUnitGroups = 1024 consecutive groups of 4 elements (4 per thread,
// strided by 256 so warps stay coalesced).  The block finds its entry by binary search over unit_start
// and its row by one divide; per group there is no 64-bit divide.  Interior groups whose address is
// aligned take a vector path (one 8- or 16-byte load and store); only the row ends take the scalar,
// bounds-checked one.
//
// Included by nvcc (apply_cuda.cu) and, through host_shim.h, by a host C++ compiler: the emulated CUDA
// backend of tests/test_cuda_emulated.py runs this exact body block by block and thread by thread on
// the CPU, with the launch shape of launch_units() below, so CPU CI sees the kernel's indexing.
#pragma once

#include "../apply.h"

namespace espert {
namespace cuda_kernel {

constexpr int kThreads = 256;
constexpr int kGroupsPerThread = kCudaUnitGroups / kThreads;

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

// Σ over the entry's members of c_eff · ε for the four lanes of one group.
template <int FAM>
__device__ __forceinline__ void group_sum(const PlanEntry& e, int64_t i, uint64_t g, int64_t c0,
                                          const uint64_t* __restrict__ seeds, const float* __restrict__ coeffs,
                                          float (&acc)[4]) {
  const float scale = u2f((uint32_t)e.scale_bits);
  acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
  for (int64_t m = e.member_begin; m < e.member_end; ++m) {
    const float c = fmul(coeffs[m], scale);
    if constexpr (FAM == kGaussian) {
      const F4 f = normals4(seeds[m], e.key, g);
      acc[0] = fadd(acc[0], fmul(c, f.n0));
      acc[1] = fadd(acc[1], fmul(c, f.n1));
      acc[2] = fadd(acc[2], fmul(c, f.n2));
      acc[3] = fadd(acc[3], fmul(c, f.n3));
    } else if constexpr (FAM == kRademacher) {
      // elements 4g..4g+3 are bits 4(g & 7) .. +3 of word (g >> 3) & 3 of call g >> 5
      const U4 x = rademacher_words(seeds[m], e.key, g >> 5);
      const uint32_t wd = u4_word(x, (int)((g >> 3) & 3)) >> (4 * (uint32_t)(g & 7));
      const uint32_t cb = f2u(c);
#pragma unroll
      for (int l = 0; l < 4; ++l) acc[l] = fadd(acc[l], u2f(cb ^ (((wd >> l) & 1u) << 31)));
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

template <int DT, int FAM>
__global__ void apply_kernel(const PlanEntry* __restrict__ plan, int64_t n_entries, int64_t total_units,
                             const uint64_t* __restrict__ seeds, const float* __restrict__ coeffs) {
  using S = Storage<DT>;
  using T = typename S::T;
  using V = typename Vec4<DT>::V;
  for (int64_t u = blockIdx.x; u < total_units; u += gridDim.x) {
    int64_t lo = 0, hi = n_entries - 1;  // the last entry whose unit_start <= u
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) >> 1;
      if (plan[mid].unit_start <= u)
        lo = mid;
      else
        hi = mid - 1;
    }
    const PlanEntry e = plan[lo];
    const int64_t local = u - e.unit_start;
    const int64_t i = local / e.units_per_row;  // once per block-unit of 1024 groups
    const int64_t chunk = local - i * e.units_per_row;
    const uint64_t base = e.block().row_base(i);
    // lowrank groups start at column 0; Philox families' groups are aligned to logical index 4g
    const int64_t shift = FAM == kLowRank ? 0 : (int64_t)(base & 3);
    T* row = reinterpret_cast<T*>(e.data) + i * e.row_stride;
#pragma unroll 1
    for (int s = 0; s < kGroupsPerThread; ++s) {
      const int64_t q = chunk * kCudaUnitGroups + s * kThreads + threadIdx.x;
      const int64_t c0 = 4 * q - shift;
      if (c0 >= e.cols) break;
      float acc[4];
      group_sum<FAM>(e, i, (base >> 2) + (uint64_t)q, c0, seeds, coeffs, acc);
      T* p = row + c0;
      if (c0 >= 0 && c0 + 4 <= e.cols && (reinterpret_cast<uintptr_t>(p) % sizeof(V)) == 0) {
        T x[4];
        Vec4<DT>::split(*reinterpret_cast<const V*>(p), x);
#pragma unroll
        for (int l = 0; l < 4; ++l) x[l] = add_to<DT>(x[l], acc[l]);
        *reinterpret_cast<V*>(p) = Vec4<DT>::join(x);
      } else {
#pragma unroll
        for (int l = 0; l < 4; ++l)
          if (c0 + l >= 0 && c0 + l < e.cols) p[l] = add_to<DT>(p[l], acc[l]);
      }
    }
  }
}

// The grid of one launch over entries [0, n_entries) of a host plan: their common dtype and family, and
// the number of units.  False when the entries do not share a dtype and family or a units_per_row is
// not this kernel's (espert/ops groups and fills them).  Blocks: min(units, 2^30), grid-stride beyond.
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

}  // namespace cuda_kernel
}  // namespace espert
