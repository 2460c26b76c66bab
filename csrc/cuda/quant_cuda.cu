// CUDA kernel for quantized weights: one thread per unit (csrc/quant.h), grid-stride.  A unit owns
// whole storage words (int8/fp8: 4 bytes of one row; GPTQ: one int32 word; AWQ / CPU W4A16: 4 words;
// Marlin: 2 words), so no atomics are needed, each word is read and written once per call, and every
// Philox group's four normals are used.  Neighbouring threads touch neighbouring words in every
// layout (coalesced).  Torch-free, like apply_cuda.cu.
#include <cuda_runtime.h>

#include <stdexcept>

#include "../quant.h"

namespace espert {
namespace quant {
namespace {

template <int E, int L, int MODE>
__global__ void quant_kernel(QuantArgs a, int64_t units) {
  for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += (int64_t)gridDim.x * blockDim.x)
    run_unit<E, L, MODE>(a, u);
}

template <int E, int L, int MODE>
void launch(const QuantArgs& a, cudaStream_t s) {
  const int64_t units = Lay<L>::units(a.N, a.K);
  if (units == 0) return;
  const int threads = 256;
  const int64_t want = (units + threads - 1) / threads;
  const int blocks = (int)(want < 65535 * 16 ? want : 65535 * 16);
  quant_kernel<E, L, MODE><<<blocks, threads, 0, s>>>(a, units);
}

template <int E, int L>
void by_mode(const QuantArgs& a, cudaStream_t s) {
  switch (a.mode) {
    case kPerturb:
      launch<E, L, kPerturb>(a, s);
      break;
    case kUpdateMaster:
      launch<E, L, kUpdateMaster>(a, s);
      break;
    case kUpdateNaive:
      launch<E, L, kUpdateNaive>(a, s);
      break;
    default:
      throw std::invalid_argument(check_codes(a));
  }
}

template <int E>
void by_layout(const QuantArgs& a, cudaStream_t s) {
  if constexpr (E == kInt4) {
    switch (a.layout) {
      case kGPTQ:
        by_mode<E, kGPTQ>(a, s);
        break;
      case kAWQ:
        by_mode<E, kAWQ>(a, s);
        break;
      case kCpuW4A16:
        by_mode<E, kCpuW4A16>(a, s);
        break;
      case kMarlin:
        by_mode<E, kMarlin>(a, s);
        break;
      default:
        throw std::invalid_argument(check_codes(a));
    }
  } else {
    switch (a.layout) {
      case kNK:
        by_mode<E, kNK>(a, s);
        break;
      case kKN:
        by_mode<E, kKN>(a, s);
        break;
      default:
        throw std::invalid_argument(check_codes(a));
    }
  }
}

}  // namespace

int quant_cuda(const QuantArgs& a, void* stream) {
  const std::string err = check_codes(a);
  if (!err.empty()) throw std::invalid_argument(err);  // before any launch
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  switch (a.elem) {
    case kInt8:
      by_layout<kInt8>(a, s);
      break;
    case kFP8:
      by_layout<kFP8>(a, s);
      break;
    case kInt4:
      by_layout<kInt4>(a, s);
      break;
    default:
      throw std::invalid_argument(check_codes(a));
  }
  return (int)cudaGetLastError();
}

}  // namespace quant
}  // namespace espert
