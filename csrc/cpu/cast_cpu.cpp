// Exact narrowing of a float32 center into bf16 / fp16 weights, for restore_: round to nearest
// even, and a NaN keeps its sign and payload (the top mantissa bits), so narrow(widen(x)) returns
// every 16-bit x bit for bit.  torch's own cast canonicalizes bf16 NaNs to 0xFFFF and quiets fp16
// signaling NaNs, which is why restore cannot simply use it.  One pass, no temporaries.
#include <omp.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "../noise.h"

namespace espert {
namespace {

inline bool nan_bits(uint32_t b) { return (b & 0x7FFFFFFFu) > 0x7F800000u; }

inline uint16_t narrow_bf16(float f) {
  const uint32_t b = f2u(f);
  if (!nan_bits(b)) return f32_to_bf16(f);
  const uint16_t h = (uint16_t)(b >> 16);
  return (h & 0x7Fu) ? h : (uint16_t)(h | 0x40u);  // a payload only in the dropped bits: quiet NaN
}

inline uint16_t narrow_f16(float f) {
  const uint32_t b = f2u(f);
  if (!nan_bits(b)) return f32_to_f16(f);
  const uint16_t h = (uint16_t)(((b >> 16) & 0x8000u) | 0x7C00u | ((b >> 13) & 0x3FFu));
  return (h & 0x3FFu) ? h : (uint16_t)(h | 0x200u);
}

// src: contiguous [rows, cols]; dst: rows of `cols` elements, `ld` elements apart.
template <uint16_t (*Narrow)(float)>
void narrow_rows(const float* src, uint16_t* dst, int64_t rows, int64_t cols, int64_t ld) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t per_row = (cols + kChunk - 1) / kChunk, tasks = rows * per_row;
#pragma omp parallel for schedule(static) if (rows * cols >= 4 * kChunk)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t r = t / per_row, c0 = (t % per_row) * kChunk, c1 = c0 + kChunk < cols ? c0 + kChunk : cols;
    const float* s = src + r * cols;
    uint16_t* d = dst + r * ld;
    for (int64_t c = c0; c < c1; ++c) d[c] = Narrow(s[c]);
  }
}

}  // namespace

void register_cast(pybind11::module_& m) {
  m.def(
      "narrow_f32_cpu",
      [](uintptr_t src, uintptr_t dst, int dtype, int64_t rows, int64_t cols, int64_t ld) {
        const float* s = reinterpret_cast<const float*>(src);
        uint16_t* d = reinterpret_cast<uint16_t*>(dst);
        pybind11::gil_scoped_release release;
        switch (dtype) {
          case kBFloat16:
            narrow_rows<narrow_bf16>(s, d, rows, cols, ld);
            break;
          case kFloat16:
            narrow_rows<narrow_f16>(s, d, rows, cols, ld);
            break;
          default: {
            pybind11::gil_scoped_acquire acquire;
            throw pybind11::value_error("narrow_f32_cpu: dtype code must be float16 or bfloat16, got " +
                                        std::to_string(dtype));
          }
        }
      },
      "dst = float32 src [rows, cols] (contiguous) rounded to nearest even in bf16 / fp16 (dtype code), NaN "
      "sign and payload kept; dst rows are ld elements apart.  Host pointers.");
}

}  // namespace espert
