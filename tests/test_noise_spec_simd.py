"""The hand-vectorized normal transforms (csrc/cpu/normals_avx512.h, csrc/cpu/normals_avx2.h) against
the scalar spec math of csrc/noise.h, exhaustively: all 2^24 radius inputs and all 2^24 angle inputs,
plus whole tiles (element order of the transpose; for AVX2 also its Philox, from seeds, across a
carry of the counter's low word); and gaussian-icdf's transform (icdf16 / icdf8, gathers and fused
multiply-adds) over all 2^24 inputs its spec reads, and its tiles.

Machines without AVX-512 (this project's CI machines among them) cannot run the intrinsics, so the
header is compiled a second time against SIMDe, a portable implementation of the same intrinsics
(pip package ``simde-py``): the bit logic is checked everywhere, the native code where the processor
has AVX-512.  The AVX2 header runs natively (every x86-64 machine this project targets has AVX2).
The kernel's own ISA paths are checked end to end in tests/test_ops.py."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++")

DRIVER = r"""
#include <cstdio>
#include <cstring>
#include "noise.h"
#include "cpu/normals_avx512.h"
using namespace espert;
static uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
int main() {
  long n = 0, bad_r = 0, bad_c = 0, bad_s = 0, bad_tile = 0;
  alignas(64) uint32_t xs[16];
  alignas(64) float r[16], co[16], so[16];
  // every 24-bit input k once; the 8 low bits (ignored by the spec) vary
  for (uint32_t k0 = 0; k0 < (1u << 24); k0 += 16) {
    for (int j = 0; j < 16; ++j) { const uint32_t k = k0 + j; xs[j] = (k << 8) | ((k * 2654435761u) >> 24); }
    const __m512i x = _mm512_loadu_si512(xs);
    _mm512_storeu_ps(r, avx512::radius16(x));
    __m512 c, s;
    avx512::sincos16(x, c, s);
    _mm512_storeu_ps(co, c);
    _mm512_storeu_ps(so, s);
    for (int j = 0; j < 16; ++j, ++n) {
      float cr, sr;
      sincos_turn(xs[j], cr, sr);
      bad_r += bits(r[j]) != bits(fsqrt(neg2log_uniform(xs[j])));
      bad_c += bits(co[j]) != bits(cr);
      bad_s += bits(so[j]) != bits(sr);
    }
  }
  const uint64_t seed = 0x0123456789ABCDEFull, key = 0xFEDCBA9876543210ull;
  long bad_icdf = 0, bad_icdf_tile = 0;
  for (uint64_t g0 = (1ull << 32) - 4096; g0 < (1ull << 32) + 4096; g0 += 16) {
    alignas(64) uint32_t x[4][16];
    alignas(64) float nv[64];
    for (int j = 0; j < 16; ++j) {
      const U4 w = philox_call(seed, key, g0 + j);
      x[0][j] = w.x0; x[1][j] = w.x1; x[2][j] = w.x2; x[3][j] = w.x3;
    }
    avx512::normals_tile16(x, nv);
    alignas(64) float ni[64];
    avx512::icdf_tile16(x, ni);
    for (int j = 0; j < 16; ++j) {
      const F4 f = normals4(seed, key, g0 + j), h = icdf_normals4(seed, key, g0 + j);
      bad_tile += (bits(nv[4 * j]) != bits(f.n0)) + (bits(nv[4 * j + 1]) != bits(f.n1)) +
                  (bits(nv[4 * j + 2]) != bits(f.n2)) + (bits(nv[4 * j + 3]) != bits(f.n3));
      bad_icdf_tile += (bits(ni[4 * j]) != bits(h.n0)) + (bits(ni[4 * j + 1]) != bits(h.n1)) +
                       (bits(ni[4 * j + 2]) != bits(h.n2)) + (bits(ni[4 * j + 3]) != bits(h.n3));
    }
  }
  // gaussian-icdf: every (sign, 23-bit magnitude) input once; bits 23..30 (ignored by the spec) vary
  for (uint32_t k0 = 0; k0 < (1u << 24); k0 += 16) {
    for (int j = 0; j < 16; ++j) { const uint32_t k = k0 + j; xs[j] = (k & 0x7FFFFFu) | ((k >> 23) << 31) | ((k * 2654435761u) & 0x7F800000u); }
    _mm512_storeu_ps(r, avx512::icdf16(_mm512_loadu_si512(xs)));
    for (int j = 0; j < 16; ++j) bad_icdf += bits(r[j]) != bits(icdf_normal(xs[j]));
  }
  std::printf("%ld %ld %ld %ld %ld %ld %ld\n", n, bad_r, bad_c, bad_s, bad_tile, bad_icdf, bad_icdf_tile);
  return 0;
}
"""


DRIVER_AVX2 = r"""
#include <cstdio>
#include <cstring>
#include "noise.h"
#include "cpu/normals_avx2.h"
using namespace espert;
static uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
__attribute__((target("avx2,fma"))) int run() {
  long n = 0, bad_r = 0, bad_c = 0, bad_s = 0, bad_tile = 0;
  alignas(32) uint32_t xs[8];
  alignas(32) float r[8], co[8], so[8];
  // every 24-bit input k once; the 8 low bits (ignored by the spec) vary
  for (uint32_t k0 = 0; k0 < (1u << 24); k0 += 8) {
    for (int j = 0; j < 8; ++j) { const uint32_t k = k0 + j; xs[j] = (k << 8) | ((k * 2654435761u) >> 24); }
    const __m256i x = _mm256_loadu_si256((const __m256i*)xs);
    _mm256_storeu_ps(r, avx2::radius8(x));
    __m256 c, s;
    avx2::sincos8(x, c, s);
    _mm256_storeu_ps(co, c);
    _mm256_storeu_ps(so, s);
    for (int j = 0; j < 8; ++j, ++n) {
      float cr, sr;
      sincos_turn(xs[j], cr, sr);
      bad_r += bits(r[j]) != bits(fsqrt(neg2log_uniform(xs[j])));
      bad_c += bits(co[j]) != bits(cr);
      bad_s += bits(so[j]) != bits(sr);
    }
  }
  const uint64_t seed = 0x0123456789ABCDEFull, key = 0xFEDCBA9876543210ull;
  // tiles from seeds: the counter's low word wraps inside some tiles (g0 not a multiple of 16)
  long bad_icdf = 0, bad_icdf_tile = 0;
  for (uint64_t g0 = (1ull << 32) - 4099; g0 < (1ull << 32) + 4096; g0 += 16) {
    alignas(64) float nv[64];
    avx2::normals_tile16(seed, key, g0, nv);
    alignas(64) float ni[64];
    avx2::icdf_tile16(seed, key, g0, ni);
    for (int j = 0; j < 16; ++j) {
      const F4 f = normals4(seed, key, g0 + j), h = icdf_normals4(seed, key, g0 + j);
      bad_tile += (bits(nv[4 * j]) != bits(f.n0)) + (bits(nv[4 * j + 1]) != bits(f.n1)) +
                  (bits(nv[4 * j + 2]) != bits(f.n2)) + (bits(nv[4 * j + 3]) != bits(f.n3));
      bad_icdf_tile += (bits(ni[4 * j]) != bits(h.n0)) + (bits(ni[4 * j + 1]) != bits(h.n1)) +
                       (bits(ni[4 * j + 2]) != bits(h.n2)) + (bits(ni[4 * j + 3]) != bits(h.n3));
    }
  }
  // gaussian-icdf: every (sign, 23-bit magnitude) input once; bits 23..30 (ignored by the spec) vary
  for (uint32_t k0 = 0; k0 < (1u << 24); k0 += 8) {
    for (int j = 0; j < 8; ++j) { const uint32_t k = k0 + j; xs[j] = (k & 0x7FFFFFu) | ((k >> 23) << 31) | ((k * 2654435761u) & 0x7F800000u); }
    _mm256_storeu_ps(r, avx2::icdf8(_mm256_loadu_si256((const __m256i*)xs)));
    for (int j = 0; j < 8; ++j) bad_icdf += bits(r[j]) != bits(icdf_normal(xs[j]));
  }
  std::printf("%ld %ld %ld %ld %ld %ld %ld\n", n, bad_r, bad_c, bad_s, bad_tile, bad_icdf, bad_icdf_tile);
  return 0;
}
int main() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? run() : 3; }
"""


def _has_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512vl", "avx512bw", "avx512dq"))


def _simde_include() -> str | None:
    try:
        import simde_py
    except ImportError:
        return None
    return str(simde_py.get_include())


def _run_driver(tmp_path: Path, flags: list[str], driver: str = DRIVER) -> list[int]:
    src = tmp_path / "driver.cpp"
    src.write_text(driver)
    exe = tmp_path / "driver"
    # the kernel's own exactness flags (CMakeLists.txt): no contraction, no fast-math
    subprocess.run(
        [
            CXX,
            "-std=c++17",
            "-O2",
            "-ffp-contract=off",
            "-fno-fast-math",
            "-fno-math-errno",
            "-Wno-psabi",
            "-I",
            str(ROOT / "csrc"),
            *flags,
            str(src),
            "-o",
            str(exe),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=600).stdout
    return [int(v) for v in out.split()]


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("impl", ["simde", "native"])
def test_avx512_transform_bit_identical_to_scalar_exhaustive(tmp_path, impl):
    if impl == "native":
        if not _has_avx512():
            pytest.skip("the processor has no AVX-512 F/VL/BW/DQ")
        flags = ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"]
    else:
        inc = _simde_include()
        if inc is None:
            pytest.skip("simde-py is not installed (requirements-dev.txt)")
        # SIMDe's portable _mm512_fmadd_ps is a multiply and an add (two roundings); on top of native AVX2
        # and FMA it runs as two _mm256_fmadd_ps, the fused operation gaussian-icdf's spec requires
        flags = ["-DESPERT_SIMDE", "-mavx2", "-mfma", "-I", inc]
    n, bad_radius, bad_cos, bad_sin, bad_tile, bad_icdf, bad_icdf_tile = _run_driver(tmp_path, flags)
    assert n == 1 << 24
    assert (bad_radius, bad_cos, bad_sin, bad_tile, bad_icdf, bad_icdf_tile) == (0, 0, 0, 0, 0, 0)


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_avx2_transform_and_philox_bit_identical_to_scalar_exhaustive(tmp_path):
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("the processor has no AVX2")
    n, bad_radius, bad_cos, bad_sin, bad_tile, bad_icdf, bad_icdf_tile = _run_driver(tmp_path, [], DRIVER_AVX2)
    assert n == 1 << 24
    assert (bad_radius, bad_cos, bad_sin, bad_tile, bad_icdf, bad_icdf_tile) == (0, 0, 0, 0, 0, 0)
