// Launch of the anchored-weight-decay kernel (anchor_kernel.cuh).  Torch-free: raw pointers, a dtype code
// and a stream handle, like apply_cuda.cu.
#include <cuda_runtime.h>

#include "anchor_kernel.cuh"

namespace espert {
namespace {

template <int DT>
int launch(float* master, const void* anchor, int64_t n, int norm, float p, cudaStream_t st) {
  using namespace cuda_kernel;
  const auto* a = static_cast<const typename Storage<DT>::T*>(anchor);
  const int blocks = (int)anchor_blocks(n);
  if (norm == kAnchorL2)
    anchor_kernel<DT, kAnchorL2><<<blocks, kAnchorThreads, 0, st>>>(master, a, n, p);
  else
    anchor_kernel<DT, kAnchorL1><<<blocks, kAnchorThreads, 0, st>>>(master, a, n, p);
  return (int)cudaGetLastError();
}

}  // namespace

int anchor_decay_cuda(float* master, const void* anchor, int dtype, int64_t n, int norm, float p, void* stream) {
  if (n <= 0) return 0;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat32:
      return launch<kFloat32>(master, anchor, n, norm, p, st);
    case kFloat16:
      return launch<kFloat16>(master, anchor, n, norm, p, st);
    case kBFloat16:
      return launch<kBFloat16>(master, anchor, n, norm, p, st);
    default:
      return (int)cudaErrorInvalidValue;
  }
}

}  // namespace espert
