// CUDA kernel: one thread per Philox group (four consecutive logical elements), grid-stride
// over the groups of every row of the block.  Torch-free: raw pointers and a stream handle,
// so the module builds with nvcc alone and works with any torch version.
#include <cuda_runtime.h>

#include "../apply.h"

namespace espert {
namespace {

template <int DT>
__global__ void apply_kernel(void* data, Block b, const uint64_t* __restrict__ seeds,
                             const float* __restrict__ coeffs, int64_t n, uint64_t key, int64_t groups_per_row) {
  using S = Storage<DT>;
  using T = typename S::T;
  const int64_t total = b.rows * groups_per_row;
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = t / groups_per_row;
    const uint64_t base = b.row_base(i);
    const uint64_t g = (base >> 2) + (uint64_t)(t % groups_per_row);
    const uint64_t end = base + (uint64_t)b.cols;
    if (4 * g >= end) continue;
    float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;
    for (int64_t m = 0; m < n; ++m) {
      const F4 f = normals4(seeds[m], key, g);
      const float c = coeffs[m];
      acc0 = fadd(acc0, fmul(c, f.n0));
      acc1 = fadd(acc1, fmul(c, f.n1));
      acc2 = fadd(acc2, fmul(c, f.n2));
      acc3 = fadd(acc3, fmul(c, f.n3));
    }
    T* row = reinterpret_cast<T*>(data) + i * b.row_stride;
    const float acc[4] = {acc0, acc1, acc2, acc3};
#pragma unroll
    for (int lane = 0; lane < 4; ++lane) {
      const uint64_t e = 4 * g + lane;
      if (e >= base && e < end) {
        T* w = row + (int64_t)(e - base);
        *w = S::store(fadd(S::load(*w), acc[lane]));
      }
    }
  }
}

}  // namespace

int apply_cuda(const ApplyArgs& a, void* stream) {
  const int64_t groups_per_row = (a.block.cols + 6) / 4;
  const int64_t total = a.block.rows * groups_per_row;
  if (total == 0) return 0;
  const int threads = 256;
  const int64_t want = (total + threads - 1) / threads;
  const int blocks = (int)(want < 65535 * 16 ? want : 65535 * 16);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case kFloat32:
      apply_kernel<kFloat32><<<blocks, threads, 0, s>>>(a.data, a.block, a.seeds, a.coeffs, a.n, a.key, groups_per_row);
      break;
    case kFloat16:
      apply_kernel<kFloat16><<<blocks, threads, 0, s>>>(a.data, a.block, a.seeds, a.coeffs, a.n, a.key, groups_per_row);
      break;
    case kBFloat16:
      apply_kernel<kBFloat16><<<blocks, threads, 0, s>>>(a.data, a.block, a.seeds, a.coeffs, a.n, a.key, groups_per_row);
      break;
  }
  return (int)cudaGetLastError();
}

}  // namespace espert
