// The CUDA kernel for quantized weights and its grid (quant_cuda.cu launches it): one thread per unit of
// csrc/quant.h, grid-stride.  Included by nvcc and, through host_shim.h, by the emulated CUDA backend of
// the tests (tests/cuda_host/emulate.cpp), which runs it block by block with the same grid.
#pragma once

#include "../quant.h"

namespace espert {
namespace quant {

constexpr int kQuantThreads = 256;

template <int E, int L, int MODE>
__global__ void quant_kernel(QuantArgs a, int64_t units) {
  for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += (int64_t)gridDim.x * blockDim.x)
    run_unit<E, L, MODE>(a, u);
}

// Blocks of a launch over `units` units: one thread each, at most 65535·16 blocks (grid-stride beyond).
inline int64_t quant_blocks(int64_t units) {
  const int64_t want = (units + kQuantThreads - 1) / kQuantThreads;
  return want < 65535 * 16 ? want : 65535 * 16;
}

}  // namespace quant
}  // namespace espert
