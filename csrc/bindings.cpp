// Python bindings of the compiled kernels (module espert._C).  Pointers travel as integers so
// that the module needs no torch headers; espert/ops validates every argument first.
#include <omp.h>
#include <pybind11/pybind11.h>

#include "anchor.h"
#include "apply.h"
#include "quant.h"

namespace py = pybind11;
using namespace espert;

namespace espert {
// A recording perturb's list from the bindings' integers (count 0: none; capacity < 0 is refused).
PatchList patch_list(uintptr_t records, int64_t capacity, uintptr_t count) {
  if (count && (capacity < 0 || (capacity > 0 && records == 0)))
    throw py::value_error("patch list: capacity >= 0 and records needed");
  return PatchList{reinterpret_cast<int64_t*>(records), capacity, reinterpret_cast<int64_t*>(count)};
}
void register_cast(py::module_& m);    // csrc/cpu/cast_cpu.cpp: exact float32 -> bf16/fp16 for restore_
void register_anchor(py::module_& m);  // csrc/cpu/anchor_cpu.cpp: anchored weight decay of the host master
#ifdef ESPERT_WITH_CUDA
int anchor_decay_cuda(float* master, const void* anchor, int dtype, int64_t n, int norm, float p, void* stream);
#endif
}  // namespace espert

PYBIND11_MODULE(_C, m) {
  register_cast(m);
  register_anchor(m);
  m.doc() = "espert compiled kernels (CPU, and CUDA when built with nvcc)";
  // Codes shared with Python (espert/ops, kernels/apply.py derive theirs from these).
  m.attr("DTYPE_CODES") = py::dict(py::arg("float32") = (int)kFloat32, py::arg("float16") = (int)kFloat16,
                                   py::arg("bfloat16") = (int)kBFloat16);
  m.attr("FAMILY_CODES") = py::dict(py::arg("gaussian") = (int)kGaussian, py::arg("rademacher") = (int)kRademacher,
                                    py::arg("lowrank") = (int)kLowRank, py::arg("gaussian-icdf") = (int)kGaussianIcdf);
  m.attr("PLAN_FIELDS") = py::make_tuple(ESPERT_PLAN_FIELDS);
  m.def("units_per_row", &units_per_row, py::arg("family"), py::arg("cols"), py::arg("unit_groups"),
        "Launch units per row of `cols` columns in noise family `family`, a unit being `unit_groups` groups of 4 "
        "elements (at least 1): the formula of the CPU tiles, the CUDA launch and espert/ops.");
  m.def(
      "check_plan",
      [](uintptr_t plan, int64_t n_entries, int64_t n_members) {
        const char* err = check_plan(reinterpret_cast<const PlanEntry*>(plan), n_entries, n_members);
        if (err) throw py::value_error(err);
      },
      "Raise ValueError if a host launch plan has an unknown code or a bad geometry.");
  m.def(
      "apply_many_cpu",
      [](uintptr_t plan, int64_t n_entries, uintptr_t seeds, uintptr_t coeffs, int64_t n_members, uintptr_t records,
         int64_t capacity, uintptr_t count) {
        const PatchList patch = patch_list(records, capacity, count);
        py::gil_scoped_release release;  // apply_many_cpu checks the plan first (std::invalid_argument: ValueError)
        apply_many_cpu(reinterpret_cast<const PlanEntry*>(plan), n_entries, reinterpret_cast<const uint64_t*>(seeds),
                       reinterpret_cast<const float*>(coeffs), n_members, count ? &patch : nullptr);
      },
      py::arg("plan"), py::arg("n_entries"), py::arg("seeds"), py::arg("coeffs"), py::arg("n_members"),
      py::arg("records") = 0, py::arg("capacity") = 0, py::arg("count") = 0,
      "In place, for every entry of the int64 launch plan [n_entries, len(PLAN_FIELDS)]: w += sum_n c_n * eps.  "
      "One OpenMP region over all entries.  count != 0: also list the elements subtraction would not restore in "
      "records (int64 [capacity, 2]) and count them in *count (int64).  Host pointers.");
  m.def(
      "apply_patch_cpu",
      [](uintptr_t records, int64_t n) {
        const auto* r = reinterpret_cast<const int64_t*>(records);
        if (const char* err = check_patch(r, n)) throw py::value_error(err);
        py::gil_scoped_release release;
        apply_patch_cpu(r, n);
      },
      "Write the first n records (int64 [n, 2]: address, old bits | dtype << 32) of a patch list back.  Host "
      "pointers.");
  m.def("cpu_isa", &cpu_isa, "The float kernels' CPU code path: 'avx512', 'avx2' or 'generic'.");
  // This module links its own OpenMP runtime (torch bundles another), so torch.set_num_threads does not
  // reach it: espert/ops forwards torch's thread count before every CPU call.
  m.def("set_num_threads", [](int n) { omp_set_num_threads(n > 0 ? n : 1); }, "Threads of espert's CPU kernels.");
  m.def("get_num_threads", []() { return omp_get_max_threads(); }, "Threads of espert's CPU kernels.");
  // Quantized codes (csrc/quant.h), exported once: kernels/quant.py and espert/quant/ops.py derive theirs.
  {
    using namespace quant;
    m.attr("QUANT_ELEM_CODES") =
        py::dict(py::arg("int8") = (int)kInt8, py::arg("fp8") = (int)kFP8, py::arg("int4") = (int)kInt4);
    m.attr("QUANT_LAYOUT_CODES") =
        py::dict(py::arg("nk") = (int)kNK, py::arg("kn") = (int)kKN, py::arg("gptq") = (int)kGPTQ,
                 py::arg("awq") = (int)kAWQ, py::arg("cpu_w4a16") = (int)kCpuW4A16, py::arg("marlin") = (int)kMarlin);
    // Philox groups per work unit of each layout (Lay<L>::G)
    m.attr("QUANT_UNIT_GROUPS") = py::dict(
        py::arg("nk") = Lay<kNK>::G, py::arg("kn") = Lay<kKN>::G, py::arg("gptq") = Lay<kGPTQ>::G,
        py::arg("awq") = Lay<kAWQ>::G, py::arg("cpu_w4a16") = Lay<kCpuW4A16>::G, py::arg("marlin") = Lay<kMarlin>::G);
    m.attr("QUANT_SCALE_KIND_CODES") = py::dict(
        py::arg("tensor") = (int)kPerTensor, py::arg("channel") = (int)kPerChannel, py::arg("grouped") = (int)kGrouped,
        py::arg("marlin_grouped") = (int)kMarlinGrouped, py::arg("marlin_channel") = (int)kMarlinChannel);
    m.attr("QUANT_MODE_CODES") = py::dict(py::arg("perturb") = (int)kPerturb, py::arg("master") = (int)kUpdateMaster,
                                          py::arg("naive") = (int)kUpdateNaive);
  }
  m.attr("QUANT_FIELDS") = py::make_tuple(ESPERT_QUANT_FIELDS);
  m.def(
      "quant_cpu",
      [](uintptr_t entry) {
        const quant::QuantArgs a = reinterpret_cast<const quant::QuantEntry*>(entry)->args();
        py::gil_scoped_release release;
        quant::quant_cpu(a);
      },
      "Quantized codes in place, for the int64 row [len(QUANT_FIELDS)] at address `entry`: perturb (mode 0), update "
      "with a float32 master (1) or naive (2), with the noise family code `family` (lowrank: rank and the staged "
      "factors A' [n, N, r], Bt [n, r, K]).  Host pointers.");
#ifdef ESPERT_WITH_CUDA
  m.def(
      "quant_cuda",
      [](uintptr_t entry, uintptr_t stream) {
        const quant::QuantArgs a = reinterpret_cast<const quant::QuantEntry*>(entry)->args();
        const int err = quant::quant_cuda(a, reinterpret_cast<void*>(stream));
        if (err != 0) throw std::runtime_error("espert quant CUDA kernel failed with cudaError " + std::to_string(err));
      },
      "Like quant_cpu (the row on the host), with device pointers in the row and a cudaStream_t handle.");
#endif
#ifdef ESPERT_WITH_CUDA
  m.attr("has_cuda") = true;
  m.attr("cuda_archs") = ESPERT_CUDA_ARCHS;  // what nvcc compiled for, e.g. "80,90"
  m.attr("CUDA_UNIT_GROUPS") = kCudaUnitGroups;
  m.def(
      "apply_many_cuda",
      [](uintptr_t host_plan, uintptr_t dev_plan, int64_t n_entries, int64_t n_members, uintptr_t seeds,
         uintptr_t coeffs, uintptr_t stream, uintptr_t records, int64_t capacity, uintptr_t count) {
        const auto* hp = reinterpret_cast<const PlanEntry*>(host_plan);
        if (const char* err = check_plan(hp, n_entries, n_members)) throw py::value_error(err);
        const PatchList patch = patch_list(records, capacity, count);
        const int err = apply_many_cuda(
            hp, reinterpret_cast<const PlanEntry*>(dev_plan), n_entries, reinterpret_cast<const uint64_t*>(seeds),
            reinterpret_cast<const float*>(coeffs), reinterpret_cast<void*>(stream), count ? &patch : nullptr);
        if (err != 0)
          throw std::runtime_error("espert CUDA kernel launch failed with cudaError " + std::to_string(err));
      },
      py::arg("host_plan"), py::arg("dev_plan"), py::arg("n_entries"), py::arg("n_members"), py::arg("seeds"),
      py::arg("coeffs"), py::arg("stream"), py::arg("records") = 0, py::arg("capacity") = 0, py::arg("count") = 0,
      "One launch over plan entries sharing a dtype and a family: host plan (for the grid), device plan, seeds, "
      "coeffs and a cudaStream_t handle; records/capacity/count: a recording perturb's list (as apply_many_cpu; "
      "records device-writable, count in device memory).");
  m.def(
      "anchor_decay_cuda",
      [](uintptr_t master, uintptr_t anchor, int dtype, int64_t n, int norm, float p, uintptr_t stream) {
        if (norm != kAnchorL2 && norm != kAnchorL1) throw py::value_error("anchor_decay_cuda: unknown norm code");
        const int err = anchor_decay_cuda(reinterpret_cast<float*>(master), reinterpret_cast<const void*>(anchor),
                                          dtype, n, norm, p, reinterpret_cast<void*>(stream));
        if (err != 0)
          throw std::runtime_error("espert anchor CUDA launch failed with cudaError " + std::to_string(err));
      },
      "Like anchor_decay_cpu, with device pointers and a cudaStream_t handle.");
  m.def(
      "apply_patch_cuda",
      [](uintptr_t records, int64_t n, uintptr_t stream) {
        const int err = apply_patch_cuda(reinterpret_cast<const int64_t*>(records), n, reinterpret_cast<void*>(stream));
        if (err != 0) throw std::runtime_error("espert CUDA patch launch failed with cudaError " + std::to_string(err));
      },
      "Write the first n records of a device-readable patch list back (device addresses), on a cudaStream_t.");
#else
  m.attr("has_cuda") = false;
  m.attr("cuda_archs") = "";
#endif
}
