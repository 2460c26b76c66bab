// The emulated CUDA backend's engine: the CUDA kernel bodies (csrc/cuda/apply_kernel.cuh,
// csrc/cuda/quant_kernel.cuh) compiled as host C++ through csrc/cuda/host_shim.h and launched block by
// block, thread by thread, with the real launch shape (launch_units / launch_blocks, quant_blocks) or a
// forced smaller grid, so the grid-stride loops run.  tests/cuda_host/emulated.py builds it (plain and
// under ASan/UBSan) and drives it as the ops backend "cuda_emulated".
//
//   emulate IN OUT          one launch
//   emulate --unit-groups   prints kCudaUnitGroups (the unit the ops plan in)
//
// IN (int64 little-endian words): kind (0: a float plan launch, 1: a quantized call); n_regions, then
// per region its byte size, its address modulo 256 on the caller's side (kept, so the kernel sees the
// alignment the caller's tensors have) and its bytes (padded to 8); n_members, seeds [n], coefficients
// as float32 (padded to 8); max_blocks (0: the real grid); then kind 0: n_entries and the plan rows
// [n, 18]; kind 2: the same, then a patch capacity (a recording perturb); kind 3: anchored weight decay (master and
// anchor pointer fields, n, dtype code, norm code, p as float32 padded to 8); kind 1: one QuantEntry row (26 words; its
// seeds, coeffs and n are replaced by the above). Pointer fields (plan: data, stage_a, stage_b; quant: codes, scales,
// master, stage_a, stage_b) are (region + 1) << 44 | byte offset (0: null).  Each region is its own allocation, ending
// where the region ends, so ASan sees any byte past it.  The caller checks the plan (_C.check_plan) first. OUT: kind 2
// first the miss count and the records (addresses as pointer fields); then every region's bytes after the launch, in
// order.  Stdout: "blocks B".
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../../csrc/cuda/host_shim.h"
// host_shim.h first: the kernel headers use its CUDA names
#include "../../csrc/cuda/apply_kernel.cuh"
#include "../../csrc/cuda/quant_kernel.cuh"
#include "../../csrc/cuda/anchor_kernel.cuh"

using namespace espert;

namespace {

FILE* in;
[[noreturn]] void fail(const char* what, int code) {
  std::fprintf(stderr, "emulate: %s\n", what);
  std::exit(code);
}
int64_t word() {
  int64_t v;
  if (std::fread(&v, 8, 1, in) != 1) fail("truncated input", 2);
  return v;
}
void bytes(void* p, int64_t n) {
  if (n && std::fread(p, 1, (size_t)n, in) != (size_t)n) fail("truncated input", 2);
  char skip[8];
  const int64_t pad = (8 - n % 8) % 8;
  if (pad && std::fread(skip, 1, (size_t)pad, in) != (size_t)pad) fail("truncated input", 2);
}

std::vector<char*> region;  // the caller's region r starts at region[r] here
std::vector<char*> block;   // what was allocated (region[r] - its alignment offset)
std::vector<int64_t> size;

template <class P>
void rebase(P& field) {
  const int64_t v = (int64_t)field;
  if (!v) return;
  const int64_t r = (v >> 44) - 1;
  if (r < 0 || r >= (int64_t)region.size()) fail("pointer field names no region", 2);
  field = (P)(int64_t)(region[r] + (v & ((1ll << 44) - 1)));
}

// Every thread of a grid of `blocks` blocks runs `body` (the kernel); the kernels use no shared memory or
// barriers, and the shuffles of apply_kernel.cuh recompute the source lane's value (host_shim.h).
template <class F>
void grid(int64_t blocks, int threads, const F& body) {
  gridDim.x = (unsigned)blocks;
  blockDim.x = (unsigned)threads;
  for (int64_t b = 0; b < blocks; ++b) {
    blockIdx.x = (unsigned)b;
    for (int t = 0; t < threads; ++t) {
      threadIdx.x = (unsigned)t;
      body();
    }
  }
}

int64_t forced(int64_t blocks, int64_t max_blocks) {
  return max_blocks > 0 && max_blocks < blocks ? max_blocks : blocks;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--unit-groups") == 0) {
    std::printf("%lld\n", (long long)kCudaUnitGroups);
    return 0;
  }
  if (argc != 3) fail("usage: emulate IN OUT | emulate --unit-groups", 2);
  in = std::fopen(argv[1], "rb");
  if (!in) fail("cannot open the input", 2);
  const int64_t kind = word();
  const int64_t n_regions = word();
  for (int64_t r = 0; r < n_regions; ++r) {
    size.push_back(word());
    const int64_t align = word();
    void* p = nullptr;
    if (posix_memalign(&p, 256, (size_t)(align + size.back() ? align + size.back() : 1)) != 0) fail("out of memory", 3);
    block.push_back(static_cast<char*>(p));
    region.push_back(static_cast<char*>(p) + align);
    bytes(region.back(), size.back());
  }
  const int64_t n_members = word();
  std::vector<uint64_t> seeds(n_members);
  std::vector<float> coeffs(n_members);
  bytes(seeds.data(), 8 * n_members);
  bytes(coeffs.data(), 4 * n_members);
  const int64_t max_blocks = word();
  int64_t blocks_run = 0;
  int64_t count = 0;             // kind 2: the misses the recording perturb counted
  std::vector<int64_t> records;  // kind 2: its list
  if (kind == 0 || kind == 2) {
    const int64_t n = word();
    std::vector<PlanEntry> plan(n);
    bytes(plan.data(), n * (int64_t)sizeof(PlanEntry));
    for (PlanEntry& e : plan) {
      rebase(e.data);
      rebase(e.stage_a);
      rebase(e.stage_b);
    }
    int dtype = 0, family = 0;
    int64_t units;
    if (n > 0 && !cuda_kernel::launch_units(plan.data(), n, dtype, family, units))
      fail("the entries differ in dtype or family, or a units_per_row is not the kernel's", 4);
    const int64_t capacity = kind == 2 ? word() : 0;
    records.assign(2 * capacity + 2, 0);
    const PatchList patch{records.data(), capacity, &count};
    if (n > 0 && units > 0) {
      blocks_run = forced(cuda_kernel::launch_blocks(family, units), max_blocks);
      DTYPE_SWITCH(dtype, DT, [&] {
        FAMILY_SWITCH(family, FAM, [&] {
          grid(blocks_run, cuda_kernel::block_threads(FAM), [&] {
            if (kind == 2)
              cuda_kernel::apply_kernel<DT, FAM, true>(plan.data(), n, units, seeds.data(), coeffs.data(), patch);
            else
              cuda_kernel::apply_kernel<DT, FAM>(plan.data(), n, units, seeds.data(), coeffs.data(), patch);
          });
        });
      });
    }
    records.resize(2 * std::min(count, capacity));
  } else if (kind == 1) {
    using namespace quant;  // QUANT_SWITCH names the codes unqualified
    QuantEntry q;
    bytes(&q, (int64_t)sizeof(q));
    rebase(q.codes);
    rebase(q.scales);
    rebase(q.master);
    rebase(q.stage_a);
    rebase(q.stage_b);
    q.seeds = (int64_t)seeds.data();
    q.coeffs = (int64_t)coeffs.data();
    q.n = n_members;
    const QuantArgs a = q.args();
    const std::string err = check_codes(a);
    if (!err.empty()) fail(err.c_str(), 4);
    QUANT_SWITCH(a, E, L, MODE, [&] {
      const int64_t units = Lay<L>::units(a.N, a.K);
      if (units == 0) return;
      blocks_run = forced(quant_blocks(units), max_blocks);
      grid(blocks_run, kQuantThreads, [&] { quant_kernel<E, L, MODE>(a, units); });
    });
  } else if (kind == 3) {  // anchored weight decay: master and anchor pointers, n, dtype, norm, p (float32)
    float* master = nullptr;
    const void* anchor = nullptr;
    master = reinterpret_cast<float*>(word());
    anchor = reinterpret_cast<const void*>(word());
    rebase(master);
    rebase(anchor);
    const int64_t n = word(), dtype = word(), norm = word();
    float p;
    bytes(&p, 4);
    if (n > 0) {
      blocks_run = forced(cuda_kernel::anchor_blocks(n), max_blocks);
      DTYPE_SWITCH((int)dtype, DT, [&] {
        const auto* a = static_cast<const typename Storage<DT>::T*>(anchor);
        grid(blocks_run, cuda_kernel::kAnchorThreads, [&] {
          if (norm == kAnchorL2)
            cuda_kernel::anchor_kernel<DT, kAnchorL2>(master, a, n, p);
          else
            cuda_kernel::anchor_kernel<DT, kAnchorL1>(master, a, n, p);
        });
      });
    }
  } else {
    fail("unknown kind", 2);
  }
  std::fclose(in);
  FILE* out = std::fopen(argv[2], "wb");
  if (!out) fail("cannot open the output", 2);
  if (kind == 2) {  // the count, then the records with their addresses as pointer fields (region + 1) << 44 | offset
    for (size_t j = 0; j < records.size(); j += 2) {
      const char* a = reinterpret_cast<const char*>(records[j]);
      size_t r = 0;
      while (r < region.size() && !(a >= region[r] && a < region[r] + size[r])) ++r;
      if (r == region.size()) fail("a record's address is in no region", 5);
      records[j] = (int64_t)(r + 1) << 44 | (int64_t)(a - region[r]);
    }
    std::fwrite(&count, 8, 1, out);
    std::fwrite(records.data(), 8, records.size(), out);
  }
  for (size_t r = 0; r < region.size(); ++r) {
    std::fwrite(region[r], 1, (size_t)size[r], out);
    std::free(block[r]);
  }
  std::fclose(out);
  std::printf("blocks %lld\n", (long long)blocks_run);
  return 0;
}
