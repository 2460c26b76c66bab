// What apply_kernel.cuh needs from CUDA, as host C++, so the kernel body compiles with g++ for the
// emulated backend (tests/cuda_host/emulate.cpp).  A "launch" is a loop over blocks and threads that
// sets the index variables below; the kernel has no shared memory, barriers or warp operations, so
// running its threads one after another computes what the GPU computes.  Never included by nvcc.
#pragma once
#if defined(__CUDACC__)
#error "host_shim.h is for host compilers only"
#endif

#include <cstdint>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))

struct dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline dim3 threadIdx, blockIdx, blockDim, gridDim;  // set by the emulated launch

struct float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct uint2 {
  uint32_t x, y;
};
inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }
