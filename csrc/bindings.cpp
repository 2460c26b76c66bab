// Python bindings of the compiled kernels (module espert._C).  Pointers travel as integers so
// that the module needs no torch headers; espert/ops.py validates every argument first.
#include <omp.h>
#include <pybind11/pybind11.h>

#include "apply.h"
#include "quant.h"

namespace py = pybind11;
using namespace espert;

static ApplyArgs make_args(uintptr_t data, int dtype, int64_t rows, int64_t cols, int64_t row_stride,
                           uint64_t row_offset, uint64_t col_offset, uint64_t logical_cols, uintptr_t seeds,
                           uintptr_t coeffs, int64_t n, uint64_t key) {
  ApplyArgs a;
  a.data = reinterpret_cast<void*>(data);
  a.dtype = dtype;
  a.block = Block{rows, cols, row_stride, row_offset, col_offset, logical_cols};
  a.seeds = reinterpret_cast<const uint64_t*>(seeds);
  a.coeffs = reinterpret_cast<const float*>(coeffs);
  a.n = n;
  a.key = key;
  return a;
}

// Quantized-weight kernels (csrc/quant.h); espert/quant/ops.py validates every argument first.
static quant::QuantArgs make_qargs(uintptr_t codes, int elem, int layout, int64_t N, int64_t K, int64_t ld,
                                   uint64_t row_offset, uint64_t col_offset, uint64_t logical_cols,
                                   uintptr_t scales, int scale_dtype, int scale_kind, int64_t group,
                                   int64_t scale_ld, uintptr_t master, int mode, float qmin, float qmax,
                                   uintptr_t seeds, uintptr_t coeffs, int64_t n, uint64_t key) {
  quant::QuantArgs a;
  a.codes = reinterpret_cast<void*>(codes);
  a.elem = elem;
  a.layout = layout;
  a.N = N;
  a.K = K;
  a.ld = ld;
  a.row_offset = row_offset;
  a.col_offset = col_offset;
  a.logical_cols = logical_cols;
  a.scales = reinterpret_cast<const void*>(scales);
  a.scale_dtype = scale_dtype;
  a.scale_kind = scale_kind;
  a.group = group;
  a.scale_ld = scale_ld;
  a.master = reinterpret_cast<float*>(master);
  a.mode = mode;
  a.qmin = qmin;
  a.qmax = qmax;
  a.seeds = reinterpret_cast<const uint64_t*>(seeds);
  a.coeffs = reinterpret_cast<const float*>(coeffs);
  a.n = n;
  a.key = key;
  return a;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "espert compiled kernels (CPU, and CUDA when built with nvcc)";
  m.def(
      "apply_cpu",
      [](uintptr_t data, int dtype, int64_t rows, int64_t cols, int64_t row_stride, uint64_t row_offset,
         uint64_t col_offset, uint64_t logical_cols, uintptr_t seeds, uintptr_t coeffs, int64_t n, uint64_t key) {
        const ApplyArgs a = make_args(data, dtype, rows, cols, row_stride, row_offset, col_offset, logical_cols, seeds,
                                      coeffs, n, key);
        py::gil_scoped_release release;
        apply_cpu(a);
      },
      "In place: w += sum_n coeffs[n] * eps(seeds[n], key, logical index).  Pointers are host addresses.");
  m.def("cpu_isa", &cpu_isa, "The CPU code path in use: 'avx512' or 'generic'.");
  // This module links its own OpenMP runtime (torch bundles another), so torch.set_num_threads does not
  // reach it: espert/ops.py forwards torch's thread count before every CPU call.
  m.def("set_num_threads", [](int n) { omp_set_num_threads(n > 0 ? n : 1); }, "Threads of espert's CPU kernels.");
  m.def("get_num_threads", []() { return omp_get_max_threads(); }, "Threads of espert's CPU kernels.");
  m.def(
      "quant_cpu",
      [](uintptr_t codes, int elem, int layout, int64_t N, int64_t K, int64_t ld, uint64_t row_offset,
         uint64_t col_offset, uint64_t logical_cols, uintptr_t scales, int scale_dtype, int scale_kind, int64_t group,
         int64_t scale_ld, uintptr_t master, int mode, float qmin, float qmax, uintptr_t seeds, uintptr_t coeffs,
         int64_t n, uint64_t key) {
        const quant::QuantArgs a = make_qargs(codes, elem, layout, N, K, ld, row_offset, col_offset, logical_cols,
                                              scales, scale_dtype, scale_kind, group, scale_ld, master, mode, qmin,
                                              qmax, seeds, coeffs, n, key);
        py::gil_scoped_release release;
        quant::quant_cpu(a);
      },
      "Quantized codes in place: perturb (mode 0), update with a float32 master (1) or naive (2).  Host pointers.");
#ifdef ESPERT_WITH_CUDA
  m.def(
      "quant_cuda",
      [](uintptr_t codes, int elem, int layout, int64_t N, int64_t K, int64_t ld, uint64_t row_offset,
         uint64_t col_offset, uint64_t logical_cols, uintptr_t scales, int scale_dtype, int scale_kind, int64_t group,
         int64_t scale_ld, uintptr_t master, int mode, float qmin, float qmax, uintptr_t seeds, uintptr_t coeffs,
         int64_t n, uint64_t key, uintptr_t stream) {
        const quant::QuantArgs a = make_qargs(codes, elem, layout, N, K, ld, row_offset, col_offset, logical_cols,
                                              scales, scale_dtype, scale_kind, group, scale_ld, master, mode, qmin,
                                              qmax, seeds, coeffs, n, key);
        const int err = quant::quant_cuda(a, reinterpret_cast<void*>(stream));
        if (err != 0) throw std::runtime_error("espert quant CUDA kernel failed with cudaError " + std::to_string(err));
      },
      "Like quant_cpu, with device pointers and a cudaStream_t handle.");
#endif
#ifdef ESPERT_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def(
      "apply_cuda",
      [](uintptr_t data, int dtype, int64_t rows, int64_t cols, int64_t row_stride, uint64_t row_offset,
         uint64_t col_offset, uint64_t logical_cols, uintptr_t seeds, uintptr_t coeffs, int64_t n, uint64_t key,
         uintptr_t stream) {
        const ApplyArgs a = make_args(data, dtype, rows, cols, row_stride, row_offset, col_offset, logical_cols, seeds,
                                      coeffs, n, key);
        const int err = apply_cuda(a, reinterpret_cast<void*>(stream));
        if (err != 0) throw std::runtime_error("espert CUDA kernel launch failed with cudaError " + std::to_string(err));
      },
      "Like apply_cpu, with device pointers and a cudaStream_t handle.");
#else
  m.attr("has_cuda") = false;
#endif
}
