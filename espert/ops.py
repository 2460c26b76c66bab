"""The one op surface: in-place perturb, exact restore and the fused ES update.

Every op validates its arguments completely before any backend touches memory, so a
bad call raises and leaves the weights untouched.  Backends are registered in
``BACKENDS`` with a capability gate; ``backend=None`` picks the default for the
tensor's device (``ESPERT_BACKEND`` overrides it):

    cpu     C++ kernels in espert._C (AVX-512 or generic, chosen at run time)
    cuda    CUDA kernels in espert._C (when the module was built with nvcc)
    triton  Triton kernels in kernels/ (GPU; CPU tensors only under TRITON_INTERPRET=1)

All three compute the same bits: see docs/noise.md.  Quantized weights
(``espert.quant.QuantWeight``: int8, FP8, int4 GPTQ/AWQ/Marlin) go through the same three ops,
dispatched by layout to the lattice kernels of ``espert.quant`` (docs/quantized.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from espert import _C

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
U64 = 1 << 64
# Bounded temporaries for restore_: at most this many bytes of the source are converted at once.
STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class Block:
    """Where a tensor sits inside its logical parameter.

    The tensor (2-D ``[rows, cols]``, or 1-D as one row, or N-D contiguous flattened to
    ``[prod(shape[:-1]), shape[-1]]``) is the block at ``(row_offset, col_offset)`` of a logical
    ``[logical_rows, logical_cols]`` matrix; element (i, j) has logical index
    ``(row_offset + i) * logical_cols + col_offset + j`` and receives that element's noise.
    """

    row_offset: int = 0
    col_offset: int = 0
    logical_rows: int | None = None  # None: the block is the whole logical tensor
    logical_cols: int | None = None


@dataclass(frozen=True)
class _Geometry:
    rows: int
    cols: int
    row_stride: int
    row_offset: int
    col_offset: int
    logical_cols: int


def _geometry(w: torch.Tensor, block: Block | None) -> _Geometry:
    if w.dim() == 0:
        raise ValueError("espert ops need a tensor with at least one dimension, got a 0-d tensor")
    if w.dim() == 1:
        rows, cols = 1, w.shape[0]
        if w.stride(0) != 1 and cols > 1:
            raise ValueError(f"espert ops need unit stride along the last dimension, got stride {w.stride()}")
        row_stride = cols
    elif w.dim() == 2:
        rows, cols = w.shape
        if w.stride(1) != 1 and cols > 1:
            raise ValueError(
                f"espert ops need unit stride along the last dimension (a non-contiguous or transposed view), "
                f"got shape {tuple(w.shape)} with strides {w.stride()}")
        row_stride = w.stride(0) if rows > 1 else cols
        if rows > 1 and row_stride < cols:
            raise ValueError(f"rows of the tensor overlap in memory (strides {w.stride()})")
    else:
        if not w.is_contiguous():
            raise ValueError(f"espert ops need a contiguous tensor for {w.dim()}-d shapes, got strides {w.stride()}")
        cols = w.shape[-1]
        rows = w.numel() // cols if cols else 0
        row_stride = cols
    block = block or Block()
    lr = rows if block.logical_rows is None else block.logical_rows
    lc = cols if block.logical_cols is None else block.logical_cols
    ro, co = block.row_offset, block.col_offset
    if min(ro, co) < 0 or ro + rows > lr or co + cols > lc:
        raise ValueError(
            f"block of shape [{rows}, {cols}] at offset ({ro}, {co}) lies outside the logical shape [{lr}, {lc}]")
    if lr * lc >= U64:
        raise ValueError(f"logical shape [{lr}, {lc}] has more than 2^64 elements")
    return _Geometry(rows, cols, row_stride, ro, co, lc)


def _quantized(w) -> bool:
    """A quantized weight (codes + scales in a storage layout): ops dispatch to espert.quant's kernels."""
    return type(w).__name__ == "QuantWeight" and type(w).__module__.startswith("espert.quant")


def _check_weight(w: torch.Tensor) -> int:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in DTYPE_CODES:
        raise TypeError(f"unsupported dtype {w.dtype}: espert ops take float32, float16 and bfloat16 weights")
    return DTYPE_CODES[w.dtype]


def _check_u64(name: str, v) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an integer in [0, 2^64), got {v!r}")
    v = int(v)
    if not 0 <= v < U64:
        raise ValueError(f"{name} must be in [0, 2^64), got {v}")
    return v


# ---- backends ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Backend:
    name: str
    supports: Callable[[torch.Tensor], bool]  # capability gate
    apply: Callable  # (w, dtype_code, geometry, seeds uint64 ndarray, coeffs float32 ndarray, key) -> None


def sync_cpu_threads() -> None:
    """Give espert's CPU kernels torch's thread count (they run on a separate OpenMP runtime)."""
    _C.set_num_threads(torch.get_num_threads())


def _apply_cpu(w, code, g: _Geometry, seeds: np.ndarray, coeffs: np.ndarray, key: int) -> None:
    sync_cpu_threads()
    _C.apply_cpu(w.data_ptr(), code, g.rows, g.cols, g.row_stride, g.row_offset, g.col_offset, g.logical_cols,
                 seeds.ctypes.data, coeffs.ctypes.data, len(seeds), key)


def _device_arrays(w, seeds: np.ndarray, coeffs: np.ndarray):
    # [N]-sized, never proportional to the weight
    return (torch.from_numpy(seeds.view(np.int64)).to(w.device, non_blocking=False),
            torch.from_numpy(coeffs).to(w.device, non_blocking=False))


def _apply_cuda(w, code, g: _Geometry, seeds: np.ndarray, coeffs: np.ndarray, key: int) -> None:
    s, c = _device_arrays(w, seeds, coeffs)
    _C.apply_cuda(w.data_ptr(), code, g.rows, g.cols, g.row_stride, g.row_offset, g.col_offset, g.logical_cols,
                  s.data_ptr(), c.data_ptr(), len(seeds), key, torch.cuda.current_stream(w.device).cuda_stream)


def _apply_triton(w, code, g: _Geometry, seeds: np.ndarray, coeffs: np.ndarray, key: int) -> None:
    from espert.kernels.apply import apply

    s, c = _device_arrays(w, seeds, coeffs)
    apply(w, code, g.rows, g.cols, g.row_stride, g.row_offset, g.col_offset, g.logical_cols, s, c, key)


def _triton_ok(w: torch.Tensor) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return w.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


BACKENDS: dict[str, Backend] = {
    "cpu": Backend("cpu", lambda w: w.device.type == "cpu", _apply_cpu),
    "cuda": Backend("cuda", lambda w: w.is_cuda and bool(_C.has_cuda), _apply_cuda),
    "triton": Backend("triton", _triton_ok, _apply_triton),
}


def default_backend(w: torch.Tensor) -> str:
    """The backend used for ``w`` when none is named: ESPERT_BACKEND, else cpu / cuda / triton by device."""
    forced = os.environ.get("ESPERT_BACKEND")
    if forced:
        return forced
    if w.device.type == "cpu":
        return "cpu"
    if w.is_cuda:
        return "cuda" if _C.has_cuda else "triton"
    raise ValueError(f"unsupported device {w.device}: espert ops run on cpu and cuda tensors")


def available_backends(w: torch.Tensor) -> list[str]:
    """Names of the backends whose capability gate accepts ``w``."""
    return [name for name, b in BACKENDS.items() if b.supports(w)]


def _backend(w: torch.Tensor, name: str | None) -> Backend:
    name = name or default_backend(w)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}")
    b = BACKENDS[name]
    if not b.supports(w):
        raise ValueError(f"backend {name!r} cannot run on a {w.device} tensor here; available: {available_backends(w)}")
    return b


# ---- the ops -------------------------------------------------------------------------------

def check_members(seeds: Sequence[int], coeffs: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Validate population seeds and coefficients; returns (uint64 [N], float32 [N]) arrays.

    Raises ValueError on a length mismatch, a seed outside [0, 2^64), or a NaN/Inf coefficient.
    """
    seeds, coeffs = list(seeds), list(coeffs)
    if len(seeds) != len(coeffs):
        raise ValueError(f"got {len(seeds)} seeds but {len(coeffs)} coefficients")
    seed_arr = np.array([_check_u64(f"seeds[{i}]", s) for i, s in enumerate(seeds)], dtype=np.uint64)
    coeff_arr = np.array(coeffs, dtype=np.float64)
    bad = ~np.isfinite(coeff_arr)
    if bad.any():
        raise ValueError(f"coefficients must be finite; got {coeff_arr[bad][:4].tolist()} "
                         f"at positions {np.flatnonzero(bad)[:4].tolist()}")
    with np.errstate(over="ignore"):  # overflow is reported just below
        coeff32 = coeff_arr.astype(np.float32)
    if not np.isfinite(coeff32).all():
        raise ValueError("coefficients overflow float32")
    return seed_arr, coeff32


@torch.no_grad()
def es_update_(w: torch.Tensor, seeds: Sequence[int], coeffs: Sequence[float], key: int, *,
               block: Block | None = None, backend: str | None = None, master: torch.Tensor | None = None):
    """In place: ``w <- round(w + Σ_n coeffs[n] · ε(seeds[n], key, logical index))``, one pass.

    A quantized weight (``espert.quant.QuantWeight``) dispatches to its lattice kernels
    (``espert.quant.es_update_q_``; ``master`` is its optional float32 code-domain master).

    w: float32 / float16 / bfloat16 on cpu or cuda, shape [rows, cols] (unit inner stride), [n] or
    contiguous N-D.  seeds: N ints in [0, 2^64).  coeffs: N finite floats (rounded to float32).
    The sum over members is taken in float32 registers in member order; each element of ``w`` is
    read and written once, and nothing of size N × w is stored.  Returns ``w``.
    """
    if _quantized(w):
        from espert.quant.ops import es_update_q_

        return es_update_q_(w, seeds, coeffs, key, master, block=block, backend=backend)
    if master is not None:
        raise ValueError("master= is only for quantized weights; float weights keep their master in a CenterStore")
    code = _check_weight(w)
    g = _geometry(w, block)
    key = _check_u64("key", key)
    seed_arr, coeff32 = check_members(seeds, coeffs)
    b = _backend(w, backend)
    if len(seed_arr) == 0 or w.numel() == 0:
        return w
    b.apply(w, code, g, seed_arr, coeff32, key)
    return w


def perturb_(w: torch.Tensor, seed: int, key: int, sigma: float, sign: int = 1, *,
             block: Block | None = None, backend: str | None = None) -> torch.Tensor:
    """In place: ``w <- round(w + sign·σ·ε(seed, key, logical index))``.  Antithetic pairs use sign ±1.

    Same tensor rules as :func:`es_update_` (it is ``es_update_`` with one member and coefficient
    ``sign·σ``).  σ must be finite and > 0.  Undo it with :func:`restore_`, never by subtracting:
    rounding makes ``(w + σε) - σε != w`` for a few percent of bf16/fp16 elements.
    """
    if _quantized(w):
        from espert.quant.ops import perturb_q_

        return perturb_q_(w, seed, key, sigma, sign, block=block, backend=backend)
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float, np.floating)) or not math.isfinite(sigma) or sigma <= 0:
        raise ValueError(f"sigma must be a finite number > 0, got {sigma!r}")
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}")
    return es_update_(w, [seed], [sign * float(sigma)], key, block=block, backend=backend)


# 16-bit float formats: (exponent-all-ones pattern, mantissa mask, shift of the mantissa into binary32, quiet bit)
_HALF_NAN = {torch.bfloat16: (0x7F80, 0x007F, 16, 0x0040), torch.float16: (0x7C00, 0x03FF, 13, 0x0200)}


def cast_exact_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """In place: ``dst <- src`` converted to dst's dtype, round-to-nearest-even, NaN bits kept.

    dst, src: same shape, float32 / float16 / bfloat16, same device.  torch's casts turn every bf16
    NaN into 0xFFFF and quiet fp16 signaling NaNs; here a NaN keeps its sign and payload: widening
    shifts the 16-bit mantissa into the top of the binary32 mantissa, narrowing takes it back (a
    binary32 NaN whose top mantissa bits are all zero becomes the quiet NaN of that sign).  So
    narrow(widen(x)) is bit-identical for every 16-bit x.  Returns ``dst``.
    """
    dst.copy_(src)
    if dst.dtype == src.dtype or not src.dtype.is_floating_point:
        return dst
    nan = torch.isnan(src)
    if not bool(nan.any()):
        return dst
    if src.dtype == torch.float32:  # narrow
        exp, mant, shift, quiet = _HALF_NAN[dst.dtype]
        b = src.view(torch.int32)[nan]
        m = (b >> shift) & mant
        h = ((b >> 16) & 0x8000) | exp | torch.where(m == 0, torch.full_like(m, quiet), m)
        dst.view(torch.int16)[nan] = h.to(torch.int16)
    else:  # widen
        exp, mant, shift, _ = _HALF_NAN[src.dtype]
        h = src.view(torch.int16)[nan].to(torch.int32)
        b = ((h & 0x8000) << 16) | 0x7F800000 | ((h & mant) << shift)
        dst.view(torch.int32)[nan] = b
    return dst


@torch.no_grad()
def restore_(w: torch.Tensor, center: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
    """In place: ``w <- round_to_w.dtype(center)``, bit-exact, at most 64 MiB of ``center`` at a time.

    w: float32 / float16 / bfloat16 on any device, any layout the other ops accept (checked by the
    same geometry rules, so a weight ops cannot address is refused, never copied into a temporary).
    center: a contiguous tensor of w's shape, float32 or w.dtype, on any device (typically host
    memory).  Rounding is round-to-nearest-even; NaNs keep their bits (:func:`cast_exact_`), so
    restoring from a float32 master made from ``w`` returns exactly the bits ``w`` started from.
    non_blocking: same-dtype copies from pinned host memory are left asynchronous (the caller
    synchronizes).  Returns ``w``.
    """
    if _quantized(w):
        from espert.quant.ops import restore_q_

        return restore_q_(w, center)
    _check_weight(w)
    if not isinstance(center, torch.Tensor):
        raise TypeError(f"center must be a torch.Tensor, got {type(center).__name__}")
    if center.shape != w.shape:
        raise ValueError(f"center shape {tuple(center.shape)} does not match weight shape {tuple(w.shape)}")
    if center.dtype not in (torch.float32, w.dtype):
        raise TypeError(f"center dtype {center.dtype} must be float32 or the weight's dtype {w.dtype}")
    if not center.is_contiguous():
        raise ValueError(f"center must be contiguous, got strides {center.stride()}")
    if center.device.type == "meta":
        raise ValueError("center is on the meta device (it holds no data)")
    g = _geometry(w, None)
    if w.numel() == 0:
        return w
    dst = w.as_strided((g.rows, g.cols), (g.row_stride, 1))  # a view: the one geometry all ops use
    src = center.view(g.rows, g.cols)
    step = max(1, STAGING_BYTES // max(1, g.cols * src.element_size()))
    for i in range(0, g.rows, step):
        d, s = dst[i:i + step], src[i:i + step]
        if s.dtype == d.dtype:
            d.copy_(s, non_blocking=non_blocking)
        elif s.device == d.device:
            cast_exact_(d, s)
        else:  # convert next to the source (bounded staging), then one transfer
            d.copy_(cast_exact_(torch.empty(s.shape, dtype=d.dtype, device=s.device), s))
    return w
