// What apply_kernel.cuh needs from CUDA, as host C++, so the kernel body compiles with g++ for the
// emulated backend (tests/cuda_host/emulate.cpp).  A "launch" is a loop over blocks and threads that
// sets the index variables below; the kernel has no shared memory, barriers or warp operations, so
// running its threads one after another computes what the GPU computes.  Never included by nvcc.
#pragma once
#if defined(__CUDACC__)
#error "host_shim.h is for host compilers only"
#endif

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)

struct dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline dim3 threadIdx, blockIdx, blockDim, gridDim;  // set by the emulated launch

struct alignas(16) float4 {  // CUDA's alignment: a misaligned vector access faults there
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct alignas(8) uint2 {
  uint32_t x, y;
};
inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }

// streaming loads and stores: plain accesses on the host, refused where the GPU would fault
// (cudaErrorMisalignedAddress): a vector access at an address that is not a multiple of its size
template <class T>
inline void check_aligned(const T* p) {
  if (reinterpret_cast<uintptr_t>(p) % sizeof(T) != 0) {
    std::fprintf(stderr, "emulated CUDA: misaligned %zu-byte access at %p\n", sizeof(T), (const void*)p);
    std::abort();
  }
}
template <class T>
inline T __ldcs(const T* p) {
  check_aligned(p);
  return *p;
}
template <class T>
inline void __stcs(T* p, T v) {
  check_aligned(p);
  *p = v;
}

// __byte_perm(x, y, s): byte k of the result is byte (s >> 4k) & 7 of the 8 bytes y:x (x the low word)
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = ((uint64_t)y << 32) | x;
  uint32_t out = 0;
  for (int k = 0; k < 4; ++k) out |= (uint32_t)((v >> (8 * ((s >> (4 * k)) & 7))) & 0xFFu) << (8 * k);
  return out;
}
