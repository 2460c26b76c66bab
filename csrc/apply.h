// The one kernel every op is made of: w <- round(w + Σ_n c_n ε(seed_n, key, logical index)).
// perturb is this with one member (c = ±σ); es_update with N members.  The sum is
// taken in binary32 in member order starting from +0, so every backend agrees bit for bit.
#pragma once

#include <cstdint>
#include "noise.h"

namespace espert {

struct ApplyArgs {
  void* data;          // first element of the block
  int dtype;           // DType
  Block block;
  const uint64_t* seeds;  // [n]
  const float* coeffs;    // [n]
  int64_t n;
  uint64_t key;
};

// CPU: OpenMP over tiles, AVX-512 when the processor has it (unless ESPERT_CPU_ISA=generic).
void apply_cpu(const ApplyArgs& args);
// Whether the CPU kernels take their AVX-512 path: the processor has AVX-512 F/VL/BW/DQ and
// ESPERT_CPU_ISA is not "generic" (read once).  cpu_isa() names the path: "avx512" or "generic".
bool use_avx512();
const char* cpu_isa();

#ifdef ESPERT_WITH_CUDA
// CUDA: seeds and coeffs are device pointers; `stream` is a cudaStream_t.  Returns a cudaError_t.
int apply_cuda(const ApplyArgs& args, void* stream);
#endif

}  // namespace espert
