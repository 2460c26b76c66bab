// The emulated CUDA backend: csrc/cuda/apply_kernel.cuh compiled as host C++ (through host_shim.h) and
// launched block by block, thread by thread, with the real launch shape (launch_units and launch_blocks,
// or a forced smaller grid so the grid-stride loop runs).  tests/test_cuda_emulated.py builds it
// (plain and under ASan/UBSan) and feeds it launch plans made by espert/ops for the CUDA backend.
//
//   emulate IN OUT       (emulate --unit-groups prints kCudaUnitGroups)
// IN (int64 little-endian words): n_regions, then per region its byte size and bytes (padded to 8);
// n_members, seeds [n], coefficients as float32 (padded to 8); max_blocks (0: the real grid);
// n_launches, then per launch: zero_region (-1: none), use_ones, n_entries, the plan rows [n, 18].
// Pointer fields of the rows (data, stage_a, stage_b) are (region + 1) << 44 | byte offset (0: null).
// Every region is its own 256-byte aligned allocation of exactly its size (as cudaMalloc aligns, so
// the kernel takes the vector path where a GPU would; ASan sees any byte outside it).
// OUT: the regions after every launch, each as its size and bytes.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../csrc/cuda/host_shim.h"
// host_shim.h first: the kernel header uses its CUDA names
#include "../../csrc/cuda/apply_kernel.cuh"

using namespace espert;

namespace {

FILE* in;
int64_t word() {
  int64_t v;
  if (std::fread(&v, 8, 1, in) != 1) {
    std::fprintf(stderr, "emulate: truncated input\n");
    std::exit(2);
  }
  return v;
}
void bytes(void* p, int64_t n) {
  if (n && std::fread(p, 1, (size_t)n, in) != (size_t)n) {
    std::fprintf(stderr, "emulate: truncated input\n");
    std::exit(2);
  }
  const int64_t pad = (8 - n % 8) % 8;
  char skip[8];
  if (pad && std::fread(skip, 1, (size_t)pad, in) != (size_t)pad) std::exit(2);
}

template <int DT, int FAM>
void run_grid(const PlanEntry* plan, int64_t n, int64_t units, int64_t blocks, const uint64_t* seeds,
              const float* coeffs) {
  gridDim.x = (unsigned)blocks;
  blockDim.x = cuda_kernel::kThreads;
  for (int64_t b = 0; b < blocks; ++b) {
    blockIdx.x = (unsigned)b;
    for (int t = 0; t < cuda_kernel::kThreads; ++t) {
      threadIdx.x = (unsigned)t;
      cuda_kernel::apply_kernel<DT, FAM>(plan, n, units, seeds, coeffs);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--unit-groups") == 0) {  // the plan's units are in these
    std::printf("%lld\n", (long long)kCudaUnitGroups);
    return 0;
  }
  if (argc != 3) {
    std::fprintf(stderr, "usage: emulate IN OUT | emulate --unit-groups\n");
    return 2;
  }
  in = std::fopen(argv[1], "rb");
  if (!in) return 2;
  std::vector<char*> region(word());
  std::vector<int64_t> size(region.size());
  for (size_t r = 0; r < region.size(); ++r) {
    size[r] = word();
    void* p = nullptr;
    if (posix_memalign(&p, 256, size[r] ? (size_t)size[r] : 1) != 0) return 3;
    region[r] = static_cast<char*>(p);
    bytes(region[r], size[r]);
  }
  const int64_t n_members = word();
  std::vector<uint64_t> seeds(n_members);
  std::vector<float> coeffs(n_members), ones(n_members, 1.0f);
  bytes(seeds.data(), 8 * n_members);
  bytes(coeffs.data(), 4 * n_members);
  const int64_t max_blocks = word();
  const int64_t n_launches = word();
  int64_t blocks_run = 0;
  for (int64_t l = 0; l < n_launches; ++l) {
    const int64_t zero = word(), use_ones = word(), n = word();
    std::vector<PlanEntry> plan(n);
    bytes(plan.data(), n * (int64_t)sizeof(PlanEntry));
    for (PlanEntry& e : plan)
      for (int64_t* f : {&e.data, &e.stage_a, &e.stage_b})
        if (*f) *f = (int64_t)(region[(*f >> 44) - 1] + (*f & ((1ll << 44) - 1)));
    if (zero >= 0) std::memset(region[zero], 0, (size_t)size[zero]);
    int dtype, family;
    int64_t units;
    if (n == 0) continue;
    if (!cuda_kernel::launch_units(plan.data(), n, dtype, family, units)) {
      std::fprintf(stderr, "emulate: launch %lld: entries differ in dtype/family or units_per_row\n", (long long)l);
      return 4;
    }
    if (units == 0) continue;
    int64_t blocks = cuda_kernel::launch_blocks(family, units);
    if (max_blocks > 0 && max_blocks < blocks) blocks = max_blocks;
    blocks_run += blocks;
    const float* c = use_ones ? ones.data() : coeffs.data();
    DTYPE_SWITCH(dtype, DT, [&] {
      FAMILY_SWITCH(family, FAM, [&] { run_grid<DT, FAM>(plan.data(), n, units, blocks, seeds.data(), c); });
    });
  }
  std::fclose(in);
  FILE* out = std::fopen(argv[2], "wb");
  if (!out) return 2;
  for (size_t r = 0; r < region.size(); ++r) {
    std::fwrite(&size[r], 8, 1, out);
    std::fwrite(region[r], 1, (size_t)size[r], out);
    std::free(region[r]);
  }
  std::fclose(out);
  std::printf("launches %lld blocks %lld\n", (long long)n_launches, (long long)blocks_run);
  return 0;
}
