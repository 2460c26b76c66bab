// CUDA launch for quantized weights; the kernel (one thread per unit of csrc/quant.h, grid-stride) is
// quant_kernel.cuh.  A unit owns whole storage words (int8/fp8: 4 bytes of one row; GPTQ: one int32
// word; AWQ / CPU W4A16: 4 words; Marlin: 2 words), so no atomics are needed, each word is read and
// written once per call, and every Philox group's four normals are used.  Neighbouring threads touch
// neighbouring words in every layout (coalesced).  Torch-free, like apply_cuda.cu.
#include <cuda_runtime.h>

#include <stdexcept>

#include "quant_kernel.cuh"

namespace espert {
namespace quant {
namespace {

// The launch's cudaError; nothing to do returns 0 before any CUDA call (no launch, no error query),
// so an empty call works without a device (tests/test_cuda_bindings.py).
template <int E, int L, int MODE>
int launch(const QuantArgs& a, cudaStream_t s) {
  const int64_t units = Lay<L>::units(a.N, a.K);
  if (units == 0) return 0;
  quant_kernel<E, L, MODE><<<(int)quant_blocks(units), kQuantThreads, 0, s>>>(a, units);
  return (int)cudaGetLastError();
}

}  // namespace

int quant_cuda(const QuantArgs& a, void* stream) {
  const std::string err = check_codes(a);
  if (!err.empty()) throw std::invalid_argument(err);  // before any launch
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  int rc = 0;
  QUANT_SWITCH(a, E, L, MODE, [&] { rc = launch<E, L, MODE>(a, s); });
  return rc;
}

}  // namespace quant
}  // namespace espert
