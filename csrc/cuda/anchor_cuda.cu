// Launch of the anchored-weight-decay kernel (anchor_kernel.cuh).  Torch-free: raw pointers, a dtype code
// and a stream handle, like apply_cuda.cu.
#include <cuda_runtime.h>

#include "anchor_kernel.cuh"

namespace espert {

int anchor_decay_cuda(float* master, const void* anchor, int dtype, int64_t n, int norm, float p, void* stream) {
  using namespace cuda_kernel;
  if (n <= 0) return 0;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const int blocks = (int)anchor_blocks(n);
  switch (dtype) {
    case kFloat32:
      anchor_kernel<kFloat32><<<blocks, kAnchorThreads, 0, st>>>(master, static_cast<const float*>(anchor), n, norm, p);
      break;
    case kFloat16:
      anchor_kernel<kFloat16>
          <<<blocks, kAnchorThreads, 0, st>>>(master, static_cast<const uint16_t*>(anchor), n, norm, p);
      break;
    case kBFloat16:
      anchor_kernel<kBFloat16>
          <<<blocks, kAnchorThreads, 0, st>>>(master, static_cast<const uint16_t*>(anchor), n, norm, p);
      break;
    default:
      return (int)cudaErrorInvalidValue;
  }
  return (int)cudaGetLastError();
}

}  // namespace espert
