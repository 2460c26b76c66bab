// The one kernel every op is made of: w <- round(w + Σ_n c_n ε(seed_n, key, logical index)).
// perturb is this with one member (c = ±σ); es_update with N members.  The sum is
// taken in binary32 in member order starting from +0, so every backend agrees bit for bit.
// A NaN element keeps its own bits (docs/noise.md §3).
//
// One call covers a whole list of tensors: a launch plan, one row of PlanEntry per tensor (or per
// sub-block), built by espert/ops as an int64 numpy table whose column order is kPlanFields
// below (exported to Python by csrc/bindings.cpp, so the two cannot drift).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "noise.h"

namespace espert {

// Noise families (docs/noise.md §5).  Codes are exported to Python by bindings.cpp.
enum Family : int { kGaussian = 0, kRademacher = 1, kLowRank = 2, kGaussianIcdf = 3 };
constexpr int kNumDTypes = 3;
constexpr int kNumFamilies = 4;
// The families of 4-element normal groups (one Philox call per group): the same tiles and launch units.
ESPERT_HD constexpr bool is_normal_family(int64_t family) { return family == kGaussian || family == kGaussianIcdf; }

// The four normals of group g in normal family FAM.
template <int FAM>
ESPERT_HD F4 family_normals4(uint64_t seed, uint64_t key, uint64_t g) {
  static_assert(is_normal_family(FAM), "a normal family");
  if constexpr (FAM == kGaussianIcdf)
    return icdf_normals4(seed, key, g);
  else
    return normals4(seed, key, g);
}

// ---- dispatch: a runtime code -> a constexpr int inside a lambda body (FlashAttention's
// static_switch.h idiom).  Host code only; the body is instantiated once per code:
//   DTYPE_SWITCH(e.dtype, DT, [&] { run<DT>(e); });
// An unknown code throws std::invalid_argument (callers check codes first, so this is a backstop).
#define ESPERT_CASE(CODE, NAME, ...)  \
  case CODE: {                        \
    constexpr static int NAME = CODE; \
    return __VA_ARGS__();             \
  }
#define ESPERT_UNKNOWN(WHAT, VALUE) \
  default:                          \
    throw std::invalid_argument("unknown " WHAT " code " + std::to_string(VALUE))

#define DTYPE_SWITCH(VALUE, NAME, ...)          \
  [&] {                                         \
    switch (VALUE) {                            \
      ESPERT_CASE(kFloat32, NAME, __VA_ARGS__)  \
      ESPERT_CASE(kFloat16, NAME, __VA_ARGS__)  \
      ESPERT_CASE(kBFloat16, NAME, __VA_ARGS__) \
      ESPERT_UNKNOWN("dtype", VALUE);           \
    }                                           \
  }()

#define FAMILY_SWITCH(VALUE, NAME, ...)             \
  [&] {                                             \
    switch (VALUE) {                                \
      ESPERT_CASE(kGaussian, NAME, __VA_ARGS__)     \
      ESPERT_CASE(kRademacher, NAME, __VA_ARGS__)   \
      ESPERT_CASE(kLowRank, NAME, __VA_ARGS__)      \
      ESPERT_CASE(kGaussianIcdf, NAME, __VA_ARGS__) \
      ESPERT_UNKNOWN("noise family", VALUE);        \
    }                                               \
  }()

// Launch units per row of a block of `cols` columns in noise family `family`, a unit being
// `unit_groups` groups of 4 elements; at least 1.  A Philox row may start anywhere inside a group
// (gaussian) or a 128-element call (rademacher: whole calls of 32 groups); lowrank groups start at
// column 0.  The CPU tiles (apply_cpu.cpp), the CUDA launch (apply_cuda.cu) and, through
// _C.units_per_row; espert/ops/plan.py has the vectorized Python twin (tests/test_kernel_codes.py).
ESPERT_HD int64_t units_per_row(int64_t family, int64_t cols, int64_t unit_groups) {
  const int64_t groups = family == kLowRank      ? (cols + 3) / 4
                         : family == kRademacher ? 32 * ((cols + 254) / 128)
                                                 : (cols + 6) / 4;
  const int64_t units = (groups + unit_groups - 1) / unit_groups;
  return units > 1 ? units : 1;
}

// One row of the launch plan: 18 int64 fields, layout-identical to a row of the numpy table.
struct PlanEntry {
  int64_t data;   // address of the block's first element (host or device)
  int64_t dtype;  // DType
  int64_t rows, cols, row_stride;
  uint64_t row_offset, col_offset, logical_cols;
  uint64_t key;
  int64_t scale_bits;    // float32 bits of the per-tensor multiplier s: c_eff = fl(c_n · s)
  int64_t family;        // Family
  int64_t rank;          // r of lowrank:r (staging row length); 0 otherwise
  int64_t stage_a;       // lowrank: float32 [members, rows, r]: fl(K_r · A) of the block's rows
  int64_t stage_b;       // lowrank: float32 [members, r, cols]: Bᵀ of the block's columns
  int64_t member_begin;  // the entry uses members [member_begin, member_end) of seeds/coeffs
  int64_t member_end;
  int64_t units_per_row;  // GPU backends: launch units per row (filled by espert/ops)
  int64_t unit_start;     // GPU backends: first unit of this entry in its launch
  ESPERT_HD Block block() const { return Block{rows, cols, row_stride, row_offset, col_offset, logical_cols}; }
};
static_assert(sizeof(PlanEntry) == 18 * sizeof(int64_t), "PlanEntry must match the int64 plan table");

#define ESPERT_PLAN_FIELDS                                                                                        \
  "data", "dtype", "rows", "cols", "row_stride", "row_offset", "col_offset", "logical_cols", "key", "scale_bits", \
      "family", "rank", "stage_a", "stage_b", "member_begin", "member_end", "units_per_row", "unit_start"

// ---- restore="patch" (docs/architecture.md): a recording perturb lists the elements that subtraction
// cannot give back.  The restore is this kernel with the coefficients negated, whose sum for an element is
// fsub(+0, acc) bit for bit (rounding to nearest even is symmetric, and a sum started at +0 is never -0),
// then the list written over it.  So an element gets a record exactly when add_to(add_to(old, acc),
// fsub(+0, acc)) is not old, and the restore is exact by construction.
struct PatchList {
  int64_t* records;  // [capacity][2]: the element's address, then its old bits | dtype << 32
  int64_t capacity;
  int64_t* count;  // every miss is counted, also those past capacity (then the list is incomplete: copy instead)
};

template <int DT>
ESPERT_HD uint32_t storage_bits(typename Storage<DT>::T v) {
  if constexpr (DT == kFloat32)
    return f2u(v);
  else
    return (uint32_t)v;
}

// Whether the restore's subtraction takes `now` = add_to(old, acc) back to old's bits.
template <int DT>
ESPERT_HD bool subtraction_restores(typename Storage<DT>::T old, typename Storage<DT>::T now, float acc) {
  return storage_bits<DT>(add_to<DT>(now, fsub(0.0f, acc))) == storage_bits<DT>(old);
}

// n slots of the list, the first at the returned index (which may be past capacity).
ESPERT_HD int64_t reserve_records(const PatchList& p, int64_t n) {
#if defined(__CUDA_ARCH__)
  return (int64_t)atomicAdd(reinterpret_cast<unsigned long long*>(p.count), (unsigned long long)n);
#else
  return __atomic_fetch_add(p.count, n, __ATOMIC_RELAXED);
#endif
}

template <int DT>
ESPERT_HD void write_record(const PatchList& p, int64_t slot, const void* addr, typename Storage<DT>::T old) {
  if (slot >= p.capacity) return;
  p.records[2 * slot] = (int64_t)reinterpret_cast<uintptr_t>(addr);
  p.records[2 * slot + 1] = (int64_t)storage_bits<DT>(old) | ((int64_t)DT << 32);
}

// Writes one record's bits back to its element.
ESPERT_HD void write_patch(int64_t address, int64_t v) {
  if ((v >> 32) == kFloat32)
    *reinterpret_cast<uint32_t*>((uintptr_t)address) = (uint32_t)v;
  else
    *reinterpret_cast<uint16_t*>((uintptr_t)address) = (uint16_t)v;
}

// Checks a patch list's records [n][2] (dtype codes) before any write: nullptr when valid, else a message.
const char* check_patch(const int64_t* records, int64_t n);
// CPU: writes records [0, n) back (host addresses).  Throws std::invalid_argument on a bad record (first).
void apply_patch_cpu(const int64_t* records, int64_t n);

// Checks every entry's codes and geometry (dtype, family, rank, member range, sizes).  Returns
// nullptr when the plan is valid, else a message naming the first bad entry and field.  Every
// backend calls it before touching memory: an unknown code is an error, never a silent no-op.
const char* check_plan(const PlanEntry* plan, int64_t n_entries, int64_t n_members);

// CPU: one OpenMP region over the tiles of all entries; AVX-512 when the processor has it
// (unless ESPERT_CPU_ISA=generic).  seeds/coeffs are host arrays of n_members.  Throws
// std::invalid_argument on a bad plan (before any write).
// patch: a recording perturb's list (nullptr: none).
void apply_many_cpu(const PlanEntry* plan, int64_t n_entries, const uint64_t* seeds, const float* coeffs,
                    int64_t n_members, const PatchList* patch = nullptr);
// Whether the CPU kernels take their AVX-512 path: the processor has AVX-512 F/VL/BW/DQ and
// ESPERT_CPU_ISA is not "generic" (read once).  cpu_isa() names the path of the float kernels:
// "avx512", "avx2" (the generic loops compiled for AVX2) or "generic".
bool use_avx512();
const char* cpu_isa();

#ifdef ESPERT_WITH_CUDA
// CUDA: launches over the entries [0, n_entries), which must share one dtype and one family
// (espert/ops groups them).  host_plan is the host copy (for the grid size); dev_plan, seeds and
// coeffs are device pointers; `stream` is a cudaStream_t.  Returns a cudaError_t (0: launched).
// patch: a recording perturb's list (nullptr: none); its records may be pinned host memory (written
// through the mapping), its count must be device memory (atomics).
int apply_many_cuda(const PlanEntry* host_plan, const PlanEntry* dev_plan, int64_t n_entries, const uint64_t* seeds,
                    const float* coeffs, void* stream, const PatchList* patch = nullptr);
// Writes device-readable records [0, n) back (device addresses).  Returns a cudaError_t.
int apply_patch_cuda(const int64_t* records, int64_t n, void* stream);
// Philox groups (4 elements) per CUDA launch unit (apply_kernel.cuh: 128 threads with 8 groups each for the
// normal families, 256 with 4 for lowrank, a warp for Rademacher).
constexpr int64_t kCudaUnitGroups = 1024;
#endif

}  // namespace espert
