// The CUDA kernel of anchored weight decay (csrc/anchor.h's rule) for a master that lives on the device
// (CenterStore(update_on="cuda") streams master and anchor chunks through device staging).  One thread per
// element, grid-stride; no shared memory or barriers, so the emulated backend (tests/cuda_host/emulate.cpp,
// kind 3) runs this exact body thread by thread on the CPU.
#pragma once

#include "../anchor.h"

namespace espert {
namespace cuda_kernel {

constexpr int kAnchorThreads = 256;
constexpr int64_t kAnchorMaxBlocks = 65535;

inline int64_t anchor_blocks(int64_t n) {
  const int64_t b = (n + kAnchorThreads - 1) / kAnchorThreads;
  return b < kAnchorMaxBlocks ? b : kAnchorMaxBlocks;
}

template <int DT, int NORM>
__global__ void __launch_bounds__(kAnchorThreads)
    anchor_kernel(float* __restrict__ m, const typename Storage<DT>::T* __restrict__ a, int64_t n, float p) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    m[i] = anchor_rule<NORM>(m[i], Storage<DT>::load(a[i]), p);
}

}  // namespace cuda_kernel
}  // namespace espert
