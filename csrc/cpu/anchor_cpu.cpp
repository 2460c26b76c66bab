// Anchored weight decay on the host: master <- the rule of csrc/anchor.h, one pass over the float32
// master and its anchor (float32, bfloat16 or float16: the base in the weights' dtype, widened exactly).
// OpenMP over fixed chunks; the rule is elementwise, so the bits do not depend on the thread count.
#include <omp.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "../anchor.h"

namespace espert {
namespace {

template <int DT, int NORM>
void anchor_rows(float* m, const typename Storage<DT>::T* a, int64_t n, float p) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t tasks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= 4 * kChunk)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t i0 = t * kChunk, i1 = i0 + kChunk < n ? i0 + kChunk : n;
    for (int64_t i = i0; i < i1; ++i) m[i] = anchor_rule<NORM>(m[i], Storage<DT>::load(a[i]), p);
  }
}

template <int DT>
void anchor_rows(float* m, const void* a, int64_t n, int norm, float p) {
  const auto* at = static_cast<const typename Storage<DT>::T*>(a);
  norm == kAnchorL2 ? anchor_rows<DT, kAnchorL2>(m, at, n, p) : anchor_rows<DT, kAnchorL1>(m, at, n, p);
}

}  // namespace

void register_anchor(pybind11::module_& m) {
  m.attr("ANCHOR_NORM_CODES") =
      pybind11::dict(pybind11::arg("l2") = (int)kAnchorL2, pybind11::arg("l1") = (int)kAnchorL1);
  m.def(
      "anchor_decay_cpu",
      [](uintptr_t master, uintptr_t anchor, int dtype, int64_t n, int norm, float p) {
        if (norm != kAnchorL2 && norm != kAnchorL1)
          throw pybind11::value_error("anchor_decay_cpu: unknown norm code " + std::to_string(norm));
        float* mp = reinterpret_cast<float*>(master);
        pybind11::gil_scoped_release release;
        switch (dtype) {
          case kFloat32:
            anchor_rows<kFloat32>(mp, reinterpret_cast<const void*>(anchor), n, norm, p);
            break;
          case kFloat16:
            anchor_rows<kFloat16>(mp, reinterpret_cast<const void*>(anchor), n, norm, p);
            break;
          case kBFloat16:
            anchor_rows<kBFloat16>(mp, reinterpret_cast<const void*>(anchor), n, norm, p);
            break;
          default: {
            pybind11::gil_scoped_acquire acquire;
            throw pybind11::value_error("anchor_decay_cpu: unknown dtype code " + std::to_string(dtype));
          }
        }
      },
      pybind11::arg("master"), pybind11::arg("anchor"), pybind11::arg("dtype"), pybind11::arg("n"),
      pybind11::arg("norm"), pybind11::arg("p"),
      "Anchored weight decay in place: n float32 master elements and n anchor elements (dtype code), the rule of "
      "csrc/anchor.h with norm code (ANCHOR_NORM_CODES) and parameter p (l2: 1 - alpha*lambda; l1: alpha*lambda).  "
      "Host pointers, contiguous.");
}

}  // namespace espert
