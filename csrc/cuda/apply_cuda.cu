// CUDA kernel: one launch over every entry of a launch plan that shares one dtype and one noise
// family (espert/ops groups the entries, so a call makes at most one launch per pair present).  The
// kernel body is apply_kernel.cuh (shared with the emulated backend of the tests).  Torch-free: raw
// pointers and a stream handle, so the module builds with nvcc alone and works with any torch version.
#include <cuda_runtime.h>

#include "apply_kernel.cuh"

namespace espert {

int apply_many_cuda(const PlanEntry* host_plan, const PlanEntry* dev_plan, int64_t n_entries, const uint64_t* seeds,
                    const float* coeffs, void* stream, const PatchList* patch) {
  using namespace cuda_kernel;
  if (n_entries == 0) return 0;
  int dtype, family;
  int64_t units;
  if (!launch_units(host_plan, n_entries, dtype, family, units)) return (int)cudaErrorInvalidValue;
  if (units == 0) return 0;
  const int blocks = (int)launch_blocks(family, units);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  DTYPE_SWITCH(dtype, DT, [&] {
    FAMILY_SWITCH(family, FAM, [&] {
      if (patch)
        apply_kernel<DT, FAM, true>
            <<<blocks, block_threads(FAM), 0, st>>>(dev_plan, n_entries, units, seeds, coeffs, *patch);
      else
        apply_kernel<DT, FAM><<<blocks, block_threads(FAM), 0, st>>>(dev_plan, n_entries, units, seeds, coeffs,
                                                                     PatchList{nullptr, 0, nullptr});
    });
  });
  return (int)cudaGetLastError();
}

int apply_patch_cuda(const int64_t* records, int64_t n, void* stream) {
  if (n <= 0) return 0;
  const int64_t blocks = (n + 255) / 256;
  cuda_kernel::patch_kernel<<<(int)(blocks < 65536 ? blocks : 65536), 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      records, n);
  return (int)cudaGetLastError();
}

}  // namespace espert
