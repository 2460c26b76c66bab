// Quantized weights: perturb / update int8, fp8 (e4m3fn) and int4 codes in their storage layouts.
//
// The per-element math (espert/quant/reference.py is the numpy reference, docs/quantized.md the
// spec in words) and the layout maps are __host__ __device__ functions shared by the CPU kernel
// (csrc/cpu/quant_cpu.cpp) and the CUDA kernel (csrc/cuda/quant_cuda.cu).  Same exactness rules as
// noise.h: one correctly rounded binary32 operation at a time, no contraction.
//
// Work is split into *units*: a unit is G Philox groups (each 4 consecutive k of one row n, k
// aligned to 4) chosen so that the unit owns whole storage words.  Units can therefore be
// processed in parallel without atomics, and each group's Philox call feeds all four of its lanes.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "apply.h"

namespace espert {
namespace quant {

enum Elem : int { kInt8 = 0, kFP8 = 1, kInt4 = 2 };
enum Layout : int { kNK = 0, kKN = 1, kGPTQ = 2, kAWQ = 3, kCpuW4A16 = 4, kMarlin = 5 };
enum ScaleKind : int { kPerTensor = 0, kPerChannel = 1, kGrouped = 2, kMarlinGrouped = 3, kMarlinChannel = 4 };
enum Mode : int { kPerturb = 0, kUpdateMaster = 1, kUpdateNaive = 2 };

struct QuantArgs {
  void* codes;       // storage: int8 / uint8 bytes (8-bit layouts), int32 words (int4 layouts)
  int elem, layout;  // Elem, Layout
  int64_t N, K;      // logical shape [N_out, K_in] of this block
  int64_t ld;        // storage row stride in storage elements (bytes or int32 words)
  uint64_t row_offset, col_offset, logical_cols;  // the block inside the logical parameter
  const void* scales;                             // float32 / float16 / bfloat16 (DType of noise.h)
  int scale_dtype, scale_kind;
  int64_t group;          // group size along K (K for one group)
  int64_t scale_ld;       // row stride of grouped scales (elements)
  float* master;          // [N, K] row-major float32, code units (kUpdateMaster), else null
  int mode;               // Mode
  int family;             // Family of apply.h
  int64_t rank;           // kLowRank: r, and the block's staged factors (float32, made by the float kernels):
  const float* stage_a;   //   A' = fl(K_r·A) [n, N, r]
  const float* stage_b;   //   Bᵀ [n, r, K]
  float qmin, qmax;       // clamp range in code units
  const uint64_t* seeds;  // [n]
  const float* coeffs;    // [n]
  int64_t n;
  uint64_t key;
};

// One call of the quantized kernels as a row of 26 int64 fields, in the order of
// ESPERT_QUANT_FIELDS (exported to Python as _C.QUANT_FIELDS; espert/quant/ops.py builds the row
// from those names).  Pointers are addresses; unsigned fields are their bit patterns; qmin/qmax are
// float32 bits.  args() gives the typed QuantArgs the kernels take.
struct QuantEntry {
  int64_t codes, elem, layout, N, K, ld;
  uint64_t row_offset, col_offset, logical_cols;
  int64_t scales, scale_dtype, scale_kind, group, scale_ld, master, mode, family, rank, stage_a, stage_b;
  int64_t qmin_bits, qmax_bits;
  int64_t seeds, coeffs, n;
  uint64_t key;
  QuantArgs args() const {
    QuantArgs a;
    a.codes = reinterpret_cast<void*>(codes);
    a.elem = (int)elem;
    a.layout = (int)layout;
    a.N = N;
    a.K = K;
    a.ld = ld;
    a.row_offset = row_offset;
    a.col_offset = col_offset;
    a.logical_cols = logical_cols;
    a.scales = reinterpret_cast<const void*>(scales);
    a.scale_dtype = (int)scale_dtype;
    a.scale_kind = (int)scale_kind;
    a.group = group;
    a.scale_ld = scale_ld;
    a.master = reinterpret_cast<float*>(master);
    a.mode = (int)mode;
    a.family = (int)family;
    a.rank = rank;
    a.stage_a = reinterpret_cast<const float*>(stage_a);
    a.stage_b = reinterpret_cast<const float*>(stage_b);
    a.qmin = u2f((uint32_t)qmin_bits);
    a.qmax = u2f((uint32_t)qmax_bits);
    a.seeds = reinterpret_cast<const uint64_t*>(seeds);
    a.coeffs = reinterpret_cast<const float*>(coeffs);
    a.n = n;
    a.key = key;
    return a;
  }
};
static_assert(sizeof(QuantEntry) == 26 * sizeof(int64_t), "QuantEntry must match the int64 row");

#define ESPERT_QUANT_FIELDS                                                                                       \
  "codes", "elem", "layout", "N", "K", "ld", "row_offset", "col_offset", "logical_cols", "scales", "scale_dtype", \
      "scale_kind", "group", "scale_ld", "master", "mode", "family", "rank", "stage_a", "stage_b", "qmin_bits",   \
      "qmax_bits", "seeds", "coeffs", "n", "key"

// Why the codes of `a` cannot run, or "" when they can: an unknown element kind, layout, scale kind,
// scale dtype or mode, or a layout of the other element kind.  quant_cpu and quant_cuda check it first
// and throw std::invalid_argument, so no code ever falls through to another code's kernel.
inline std::string check_codes(const QuantArgs& a) {
  auto bad = [](const char* what, int v) {
    return std::string("unknown quantized ") + what + " code " + std::to_string(v);
  };
  if (a.elem != kInt8 && a.elem != kFP8 && a.elem != kInt4) return bad("element kind", a.elem);
  const bool byte_layout = a.layout == kNK || a.layout == kKN;
  const bool int4_layout = a.layout == kGPTQ || a.layout == kAWQ || a.layout == kCpuW4A16 || a.layout == kMarlin;
  if (!byte_layout && !int4_layout) return bad("layout", a.layout);
  if ((a.elem == kInt4) != int4_layout)
    return "quantized layout code " + std::to_string(a.layout) + " does not hold element kind " +
           std::to_string(a.elem);
  if (a.scale_kind < kPerTensor || a.scale_kind > kMarlinChannel) return bad("scale kind", a.scale_kind);
  if (a.scale_dtype != kFloat32 && a.scale_dtype != kFloat16 && a.scale_dtype != kBFloat16)
    return bad("scale dtype", a.scale_dtype);
  if (a.mode != kPerturb && a.mode != kUpdateMaster && a.mode != kUpdateNaive) return bad("mode", a.mode);
  if (a.family < 0 || a.family >= kNumFamilies) return bad("noise family", a.family);
  if (a.family == kLowRank && (a.rank < 1 || !a.stage_a || !a.stage_b))
    return "lowrank needs rank >= 1 and staged factors";
  return "";
}

// Unreachable after check_codes: a kernel that meets an unknown code stops instead of guessing.
#if defined(__CUDA_ARCH__)
#define ESPERT_BAD_CODE() __trap()
#else
#define ESPERT_BAD_CODE() __builtin_trap()
#endif

// QUANT_SWITCH(a, E, L, MODE, body): the element kind, layout and mode codes of QuantArgs `a` as
// constexpr ints E, L, MODE inside body (the static-switch idiom of apply.h), for the 8 (element
// kind, layout) pairs that exist times the 3 modes.  Host code only; an unknown code or pair throws
// std::invalid_argument with check_codes' message (quant_cpu / quant_cuda check first).
#define ESPERT_QUANT_CASE(A, ELEM, LAYOUT, E, L, MODE, ...) \
  if ((A).elem == ELEM && (A).layout == LAYOUT) {           \
    constexpr static int E = ELEM, L = LAYOUT;              \
    return [&] {                                            \
      switch ((A).mode) {                                   \
        ESPERT_CASE(kPerturb, MODE, __VA_ARGS__)            \
        ESPERT_CASE(kUpdateMaster, MODE, __VA_ARGS__)       \
        ESPERT_CASE(kUpdateNaive, MODE, __VA_ARGS__)        \
        default:                                            \
          throw std::invalid_argument(check_codes(A));      \
      }                                                     \
    }();                                                    \
  }
#define QUANT_SWITCH(A, E, L, MODE, ...)                            \
  [&] {                                                             \
    ESPERT_QUANT_CASE(A, kInt8, kNK, E, L, MODE, __VA_ARGS__)       \
    ESPERT_QUANT_CASE(A, kInt8, kKN, E, L, MODE, __VA_ARGS__)       \
    ESPERT_QUANT_CASE(A, kFP8, kNK, E, L, MODE, __VA_ARGS__)        \
    ESPERT_QUANT_CASE(A, kFP8, kKN, E, L, MODE, __VA_ARGS__)        \
    ESPERT_QUANT_CASE(A, kInt4, kGPTQ, E, L, MODE, __VA_ARGS__)     \
    ESPERT_QUANT_CASE(A, kInt4, kAWQ, E, L, MODE, __VA_ARGS__)      \
    ESPERT_QUANT_CASE(A, kInt4, kCpuW4A16, E, L, MODE, __VA_ARGS__) \
    ESPERT_QUANT_CASE(A, kInt4, kMarlin, E, L, MODE, __VA_ARGS__)   \
    throw std::invalid_argument(check_codes(A));                    \
  }()

// ---- the stochastic-rounding stream: group g' = g | 2^63, u = (x >> 8) * 2^-24 -----------------
ESPERT_HD F4 sr_uniforms4(uint64_t seed, uint64_t key, uint64_t g) {
  const U4 x = philox_call(seed, key, g | (1ull << 63));
  const float sc = u2f(0x33800000u);  // 2^-24
  return F4{fmul((float)(x.x0 >> 8), sc), fmul((float)(x.x1 >> 8), sc), fmul((float)(x.x2 >> 8), sc),
            fmul((float)(x.x3 >> 8), sc)};
}

// ---- the noise of one group (elements 4g .. 4g+3, one row) --------------------------------------
ESPERT_HD float plus_minus_one(uint32_t bit) { return u2f(0x3F800000u | ((bit & 1u) << 31)); }

// rademacher (docs/noise.md §5.1): a group never straddles a 128-element Philox call, so its four
// elements are bits 4(g & 7) .. 4(g & 7) + 3 of word (g >> 3) & 3 of call h = g >> 5 (bit 1: -1).
ESPERT_HD F4 rademacher4(uint64_t seed, uint64_t key, uint64_t g) {
  const uint32_t b = u4_word(rademacher_words(seed, key, g >> 5), (int)((g >> 3) & 3)) >> (4 * (uint32_t)(g & 7));
  return F4{plus_minus_one(b), plus_minus_one(b >> 1), plus_minus_one(b >> 2), plus_minus_one(b >> 3)};
}

// ε of group g's four lanes in family FAM (a normal family, or kRademacher: ±1, so c·ε is exact)
template <int FAM>
ESPERT_HD F4 group_noise4(uint64_t seed, uint64_t key, uint64_t g) {
  if constexpr (FAM == kRademacher)
    return rademacher4(seed, key, g);
  else
    return family_normals4<FAM>(seed, key, g);
}

// ---- rounding helpers ----------------------------------------------------------------------
ESPERT_HD float ffloor(float x) {
#if defined(__CUDA_ARCH__)
  return floorf(x);
#else
  return __builtin_floorf(x);
#endif
}
// nearest integer, ties to even, for |q| < 2^22 (two correctly rounded additions)
ESPERT_HD float frne(float q) { return fsub(fadd(q, 12582912.0f), 12582912.0f); }
ESPERT_HD float fclamp(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

// ---- e4m3fn (bias 7, no inf, NaN = S.1111.111, max 448) --------------------------------------
ESPERT_HD bool e4m3_isnan(uint32_t h) { return (h & 0x7Fu) == 0x7Fu; }

ESPERT_HD float e4m3_to_f32(uint32_t h) {
  const uint32_t sign = (h & 0x80u) << 24;
  const uint32_t e = (h >> 3) & 0xFu, m = h & 7u;
  if (e == 0) return u2f(sign | f2u(fmul((float)m, u2f(0x3B000000u))));  // m * 2^-9, exact
  return u2f(sign | ((e + 120u) << 23) | (m << 20));
}

// y onto the e4m3 grid (no range limit): floor(q + u) (stochastic) or RNE(q), q = y / step, exact scaling.
ESPERT_HD float e4m3_round(float y, float u, bool stochastic) {
  const uint32_t b = f2u(y) & 0x7FFFFFFFu;
  int32_t e = (int32_t)(b >> 23) - 127;
  e = e < -6 ? -6 : e;
  const float inv = u2f((uint32_t)(127 + 3 - e) << 23);
  const float quantum = u2f((uint32_t)(127 + e - 3) << 23);
  const float q = fmul(y, inv);
  const float r = stochastic ? ffloor(fadd(q, u)) : frne(q);
  return fmul(r, quantum);
}

// a float32 value on the e4m3 grid with |x| <= 448 -> its bits
ESPERT_HD uint32_t f32_to_e4m3(float x) {
  const uint32_t b = f2u(x);
  const uint32_t sign = (b >> 24) & 0x80u;
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a < 0x3C800000u) return sign | (uint32_t)fmul(u2f(a), 512.0f);  // subnormal (or 2^-6 as 0x08)
  return sign | (((a >> 20) - (120u << 3)) & 0x7Fu);
}

// ---- layouts: units and the storage location of logical element (n, k) ------------------------
struct Loc {
  int64_t word;
  int shift;
};

template <int L>
struct Lay;

// int8 / fp8 [N, K] row-major (row stride ld): a unit is one group
template <>
struct Lay<kNK> {
  static constexpr int G = 1;
  static ESPERT_HD int64_t units(int64_t N, int64_t K) { return N * (K / 4); }
  static ESPERT_HD void origin(int64_t u, int, int64_t, int64_t K, int64_t& n, int64_t& k0) {
    n = u / (K / 4);
    k0 = 4 * (u % (K / 4));
  }
  static ESPERT_HD Loc loc(int64_t n, int64_t k, int64_t ld) { return Loc{n * ld + k, 0}; }
};
// int8 / fp8 [K, N] row-major: consecutive units are consecutive n (coalesced on GPU)
template <>
struct Lay<kKN> {
  static constexpr int G = 1;
  static ESPERT_HD int64_t units(int64_t N, int64_t K) { return N * (K / 4); }
  static ESPERT_HD void origin(int64_t u, int, int64_t N, int64_t, int64_t& n, int64_t& k0) {
    n = u % N;
    k0 = 4 * (u / N);
  }
  static ESPERT_HD Loc loc(int64_t n, int64_t k, int64_t ld) { return Loc{k * ld + n, 0}; }
};
// GPTQ int32 [K/8, N]: a unit is one word = 8 consecutive k of one n = 2 groups
template <>
struct Lay<kGPTQ> {
  static constexpr int G = 2;
  static ESPERT_HD int64_t units(int64_t N, int64_t K) { return N * (K / 8); }
  static ESPERT_HD void origin(int64_t u, int j, int64_t N, int64_t, int64_t& n, int64_t& k0) {
    n = u % N;
    k0 = 8 * (u / N) + 4 * j;
  }
  static ESPERT_HD Loc loc(int64_t n, int64_t k, int64_t ld) { return Loc{(k >> 3) * ld + n, 4 * (int)(k & 7)}; }
};
// Units of 8 adjacent columns n × 4 rows k (the int4 layouts that pack along N)
struct Units8Cols {
  static constexpr int G = 8;
  static ESPERT_HD int64_t units(int64_t N, int64_t K) { return (N / 8) * (K / 4); }
  static ESPERT_HD void origin(int64_t u, int j, int64_t N, int64_t, int64_t& n, int64_t& k0) {
    n = 8 * (u % (N / 8)) + j;
    k0 = 4 * (u / (N / 8));
  }
};
// AWQ int32 [K, N/8] (nibble order 0 2 4 6 1 3 5 7): a unit is the 4 words k0..k0+3 of 8 columns
template <>
struct Lay<kAWQ> : Units8Cols {
  static ESPERT_HD Loc loc(int64_t n, int64_t k, int64_t ld) {
    const int t = (int)(n & 7);
    const int nib = (t >> 1) + 4 * (t & 1);  // AWQ_REV = [0, 4, 1, 5, 2, 6, 3, 7]
    return Loc{k * ld + (n >> 3), 4 * nib};
  }
};
// vLLM CPU W4A16 int32 [N/16, 2K]: code(n, k) in word (n/16, 2k + (n%16)/8), nibble n%8
template <>
struct Lay<kCpuW4A16> : Units8Cols {
  static ESPERT_HD Loc loc(int64_t n, int64_t k, int64_t ld) {
    return Loc{(n >> 4) * ld + 2 * k + ((n & 15) >> 3), 4 * (int)(n & 7)};
  }
};
// Marlin int32 [K/16, 2N] (the map in docs/quantized.md).  A unit is the two words th = 4x+2y, 4x+2y+1 of one warp
// in a 16x64 tile: n in {16w + x, 16w + 8 + x}, k in 4y..4y+3 and 4y+8..4y+11 = 4 groups.
template <>
struct Lay<kMarlin> {
  static constexpr int G = 4;
  static ESPERT_HD int64_t units(int64_t N, int64_t K) { return (N / 64) * (K / 16) * 64; }
  static ESPERT_HD void origin(int64_t u, int j, int64_t N, int64_t, int64_t& n, int64_t& k0) {
    const int64_t tile = u >> 6;
    const int r = (int)(u & 63);
    const int w = r & 3, y = (r >> 2) & 1, x = r >> 3;
    const int64_t nt = tile % (N / 64), kt = tile / (N / 64);
    n = 64 * nt + 16 * w + 8 * (j >> 1) + x;
    k0 = 16 * kt + 4 * y + 8 * (j & 1);
  }
  static ESPERT_HD Loc loc(int64_t n, int64_t k, int64_t ld) {
    const int64_t kt = k >> 4, nt = n >> 6;
    const int kk = (int)(k & 15), nn = (int)(n & 63);
    const int warp = nn >> 4, half = (nn & 15) >> 3;
    const int th = 4 * (nn & 7) + ((kk & 7) >> 1);
    const int v = (kk & 1) + 2 * (kk >> 3) + 4 * half;
    const int slot = (v & 1) ? 4 + (v >> 1) : (v >> 1);
    return Loc{kt * ld + nt * 128 + 4 * th + warp, 4 * slot};
  }
};

ESPERT_HD int64_t marlin_scale_col(int64_t n, bool grouped) {
  if (grouped) {
    const int64_t nn = n & 63;
    return (n & ~(int64_t)63) + 8 * (nn & 7) + (nn >> 3);
  }
  const int64_t nn = n & 31;
  return (n & ~(int64_t)31) + 8 * ((nn >> 1) & 3) + 2 * (nn >> 3) + (nn & 1);
}

ESPERT_HD float load_scale(const QuantArgs& a, int64_t n, int64_t k) {
  int64_t i;
  switch (a.scale_kind) {
    case kPerTensor:
      i = 0;
      break;
    case kPerChannel:
      i = n;
      break;
    case kGrouped:
      i = (k / a.group) * a.scale_ld + n;
      break;
    case kMarlinGrouped:
      i = (k / a.group) * a.scale_ld + marlin_scale_col(n, true);
      break;
    case kMarlinChannel:
      i = (k / a.group) * a.scale_ld + marlin_scale_col(n, false);
      break;
    default:
      ESPERT_BAD_CODE();
      return 0.0f;
  }
  switch (a.scale_dtype) {
    case kFloat32:
      return reinterpret_cast<const float*>(a.scales)[i];
    case kFloat16:
      return f16_to_f32(reinterpret_cast<const uint16_t*>(a.scales)[i]);
    case kBFloat16:
      return bf16_to_f32(reinterpret_cast<const uint16_t*>(a.scales)[i]);
    default:
      ESPERT_BAD_CODE();
      return 0.0f;
  }
}

// ---- per-element code edits (ints: code units; fp8: bits) -------------------------------------
// acc: Σ c_m ε_m (float32), s: scale, u: SR uniform (perturb only), m: master slot (update-master only)
template <int E, int MODE>
ESPERT_HD uint32_t edit_code(uint32_t code, float acc, float s, float u, float* m, float qmin, float qmax) {
  const float v = fdiv(acc, s);
  if (E == kFP8) {
    if (e4m3_isnan(code)) return code;
    if (MODE == kPerturb) {
      const float y = fadd(e4m3_to_f32(code), v);
      return f32_to_e4m3(fclamp(e4m3_round(y, u, true), qmin, qmax));
    }
    const float base = MODE == kUpdateMaster ? *m : e4m3_to_f32(code);
    const float x = fclamp(fadd(base, v), qmin, qmax);
    if (MODE == kUpdateMaster) *m = x;
    return f32_to_e4m3(e4m3_round(x, 0.0f, false));
  }
  const float c = E == kInt8 ? (float)(int32_t)(int8_t)(uint8_t)code : (float)code;
  float x;
  if (MODE == kPerturb) {
    x = fclamp(fadd(c, ffloor(fadd(v, u))), qmin, qmax);
  } else {
    const float base = MODE == kUpdateMaster ? *m : c;
    const float t = fclamp(fadd(base, v), qmin, qmax);
    if (MODE == kUpdateMaster) *m = t;
    x = frne(t);
  }
  return E == kInt8 ? (uint32_t)(uint8_t)(int8_t)(int32_t)x : (uint32_t)(int32_t)x;
}

// lowrank: ε of lanes k0 .. k0+3 of block row n for member m, Σ_j fl(A'[m, n, j]·Bᵀ[m, j, k]) from +0 in j
// order (the float kernel's sum, docs/noise.md §5.2)
ESPERT_HD F4 lowrank4(const QuantArgs& a, int64_t m, int64_t n, int64_t k0) {
  const float* ar = a.stage_a + (m * a.N + n) * a.rank;
  const float* bt = a.stage_b + m * a.rank * a.K + k0;
  float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
  for (int64_t j = 0; j < a.rank; ++j) {
    const float aj = ar[j];
    const float* b = bt + j * a.K;
    t0 = fadd(t0, fmul(aj, b[0]));
    t1 = fadd(t1, fmul(aj, b[1]));
    t2 = fadd(t2, fmul(aj, b[2]));
    t3 = fadd(t3, fmul(aj, b[3]));
  }
  return F4{t0, t1, t2, t3};
}

// ε of member m for group j of a tile or unit: (block row gn, first column gk, Philox group gg)
template <int FAM>
ESPERT_HD F4 member_noise4(const QuantArgs& a, int64_t m, uint64_t seed, int64_t gn, int64_t gk, uint64_t gg) {
  if constexpr (FAM == kLowRank)
    return lowrank4(a, m, gn, gk);
  else
    return group_noise4<FAM>(seed, a.key, gg);
}

// acc[j][l] += Σ_m c_m ε_m of lane l of group j, in member order
template <int FAM, int G>
ESPERT_HD void unit_members(const QuantArgs& a, const int64_t (&gn)[G], const int64_t (&gk)[G], const uint64_t (&gg)[G],
                            float (&acc)[G][4]) {
  for (int64_t m = 0; m < a.n; ++m) {
    const uint64_t seed = a.seeds[m];
    const float c = a.coeffs[m];
    ESPERT_UNROLL
    for (int j = 0; j < G; ++j) {
      add_normals(acc[j], c, member_noise4<FAM>(a, m, seed, gn[j], gk[j], gg[j]));
    }
  }
}

// ---- one unit, start to end (the CUDA kernel's per-thread body; the CPU kernel tiles units) ------
template <int E, int L, int MODE>
ESPERT_HD void run_unit(const QuantArgs& a, int64_t u) {
  using Ly = Lay<L>;
  constexpr int G = Ly::G;
  float acc[G][4];
  int64_t gn[G], gk[G];
  uint64_t gg[G];
  ESPERT_UNROLL
  for (int j = 0; j < G; ++j) {
    Ly::origin(u, j, a.N, a.K, gn[j], gk[j]);
    gg[j] = ((a.row_offset + (uint64_t)gn[j]) * a.logical_cols + a.col_offset + (uint64_t)gk[j]) >> 2;
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  }
  if (a.family == kRademacher)
    unit_members<kRademacher, G>(a, gn, gk, gg, acc);
  else if (a.family == kLowRank)
    unit_members<kLowRank, G>(a, gn, gk, gg, acc);
  else if (a.family == kGaussianIcdf)
    unit_members<kGaussianIcdf, G>(a, gn, gk, gg, acc);
  else
    unit_members<kGaussian, G>(a, gn, gk, gg, acc);
  ESPERT_UNROLL
  for (int j = 0; j < G; ++j) {
    F4 uu{0.0f, 0.0f, 0.0f, 0.0f};
    if (MODE == kPerturb) uu = sr_uniforms4(a.seeds[0], a.key, gg[j]);
    const float us[4] = {uu.n0, uu.n1, uu.n2, uu.n3};
    const float s = load_scale(a, gn[j], gk[j]);  // the group's 4 lanes share a scale (group % 8 == 0)
    ESPERT_UNROLL
    for (int l = 0; l < 4; ++l) {
      const int64_t n = gn[j], k = gk[j] + l;
      const Loc p = Ly::loc(n, k, a.ld);
      float* m = MODE == kUpdateMaster ? a.master + n * a.K + k : nullptr;
      if (E == kInt4) {
        uint32_t* w = reinterpret_cast<uint32_t*>(a.codes) + p.word;
        const uint32_t code = (*w >> p.shift) & 0xFu;
        const uint32_t nc = edit_code<E, MODE>(code, acc[j][l], s, us[l], m, a.qmin, a.qmax);
        *w = (*w & ~(0xFu << p.shift)) | (nc << p.shift);
      } else {
        uint8_t* b = reinterpret_cast<uint8_t*>(a.codes) + p.word;
        *b = (uint8_t)edit_code<E, MODE>(*b, acc[j][l], s, us[l], m, a.qmin, a.qmax);
      }
    }
  }
}

void quant_cpu(const QuantArgs& a);
#ifdef ESPERT_WITH_CUDA
int quant_cuda(const QuantArgs& a, void* stream);
#endif

}  // namespace quant
}  // namespace espert
