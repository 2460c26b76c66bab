// Anchored weight decay (AWD, arXiv 2605.30148): the per-element rule, shared by the CPU kernel
// (csrc/cpu/anchor_cpu.cpp), the CUDA kernel (csrc/cuda/anchor_kernel.cuh, also compiled as host C++ for
// the emulated backend) and mirrored by the Triton kernel (espert/kernels/anchor.py) and the numpy
// reference (espert/noise.py anchor_decay_reference).  docs/training.md states the rule.
//
//   d = fl(m - a)                      m: the float32 master, a: the anchor (the base) widened exactly
//   l2:  m <- fl(a + fl(p · d))        p = fl32(1 - α·λ)
//   l1:  s = fl(|d| - p)               p = fl32(α·λ)
//        m <- a            if not (s > 0)
//        m <- fl(a + ±s)   with the sign of d
//
// An element whose master or anchor is not finite (NaN, ±inf) is left as it is: the rule needs both,
// and the bits stay the same on every backend.
#pragma once

#include "noise.h"

namespace espert {

enum AnchorNorm : int { kAnchorL2 = 0, kAnchorL1 = 1 };

ESPERT_HD bool finite_bits(float x) { return (f2u(x) & 0x7F800000u) != 0x7F800000u; }

// x where c, else y, by bit masks: gcc does not if-convert a float ?: under -fno-fast-math ("control flow
// in loop"), a mask it vectorizes.
ESPERT_HD float select_bits(bool c, float x, float y) {
  const uint32_t k = 0u - (uint32_t)c;
  return u2f((f2u(x) & k) | (f2u(y) & ~k));
}

// Branch-free (masks, no early return), so the CPU loop vectorizes; the norm is a template parameter.
template <int NORM>
ESPERT_HD float anchor_rule(float m, float a, float p) {
  const float d = fsub(m, a);
  float r;
  if (NORM == kAnchorL2) {
    r = fadd(a, fmul(p, d));
  } else {
    const float s = fsub(u2f(f2u(d) & 0x7FFFFFFFu), p);
    r = select_bits(s > 0.0f, fadd(a, u2f(f2u(s) | (f2u(d) & 0x80000000u))), a);
  }
  return select_bits(finite_bits(m) & finite_bits(a), r, m);
}

}  // namespace espert
