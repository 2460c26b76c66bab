"""The ops: in-place perturb, exact restore and the fused ES update (re-exported by :mod:`espert.ops`).

Every op validates its arguments completely (:mod:`.checks`) before any backend touches memory, so a
bad call raises and leaves the weights untouched; then one launch plan (:mod:`.plan`) runs on the
selected backend (:mod:`.backends`).  Inside ``torch.compile`` the ops become their torch operators
(:mod:`.torch_ops`): σ, sign, seeds and keys are checked while tracing, everything else when the
operator runs, by these same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from espert import _C
from espert.noise import NoiseFamily

from . import plan
from .backends import select, sync_cpu_threads
from .checks import (
    DTYPE_CODES,
    U64,
    Block,
    as_int64,
    check_disjoint,
    check_members,
    check_scale,
    check_sigma,
    check_sign,
    check_u64,
    check_weight,
    geometry,
    op_args,
)
from .patch import PatchList
from .plan import ONE_BITS, build_steps


@dataclass(frozen=True)
class WeightType:
    """The op implementations of a non-tensor weight type (e.g. ``espert.quant.QuantWeight``).

    perturb(w, seed, key, sigma, sign, *, block, backend, noise); update(w, seeds, coeffs, key, *, block,
    backend, master, noise); restore(w, center).  Registered with :func:`register_weight_type`.
    """

    perturb: Callable
    update: Callable
    restore: Callable


_WEIGHT_TYPES: dict[type, WeightType] = {}


def register_weight_type(cls: type, impl: WeightType) -> None:
    """Make perturb_ / es_update_ / restore_ accept instances of ``cls`` (subclasses included)."""
    _WEIGHT_TYPES[cls] = impl


def _weight_type(w) -> WeightType | None:
    """The registered implementation for ``w``'s type, or None for plain float tensors."""
    if isinstance(w, torch.Tensor):
        return None
    return next((_WEIGHT_TYPES[c] for c in type(w).__mro__ if c in _WEIGHT_TYPES), None)


def _check_items(items, fam: NoiseFamily, n: int, scales, backend: str | None):
    """Validate every (tensor, key, block) of a multi-tensor call before anything is written.
    Returns ([(w, key, geometry, dtype code)], [scale bits], Backend, device)."""
    if isinstance(items, (str, bytes, torch.Tensor)) or not hasattr(items, "__iter__"):
        raise TypeError(f"items must be a sequence of (tensor, key, block) triples, got {type(items).__name__}")
    items = list(items)
    if scales is not None:
        scales = list(scales)
        if len(scales) != len(items):
            raise ValueError(f"got {len(scales)} scales for {len(items)} tensors")
    checked, bits, be, device, seen = [], [], None, None, set()
    for k, item in enumerate(items):
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise TypeError(f"items[{k}] must be a (tensor, key, block) triple, got {item!r:.80}")
        w, key, block = item
        if _weight_type(w) is not None:
            raise TypeError(f"items[{k}] is a {type(w).__name__}: use es_update_/perturb_ on it")
        code = check_weight(w)
        key = check_u64(f"items[{k}] key", key)
        g = geometry(w, block)
        if fam.name == "lowrank" and g.logical_rows > 1:
            if g.logical_rows * fam.rank >= U64 or fam.rank * g.logical_cols >= U64:
                raise ValueError(f"items[{k}]: {fam} needs logical_rows·r and r·logical_cols below 2^64")
            if n * fam.rank * 8 > plan.STAGING_BYTES:
                raise ValueError(
                    f"{fam} with {n} members needs more than {plan.STAGING_BYTES >> 20} MiB of staging "
                    f"per row and column; use fewer members per call"
                )
        if be is None:
            be, device = select(w, backend), w.device
        elif w.device != device:  # one device per call, so one backend
            raise ValueError(f"items[{k}] is on {w.device}; a call takes tensors of one device ({device})")
        if w.numel() and (w.data_ptr(), g.rows, g.cols) in seen:
            raise ValueError(f"items[{k}]: the same tensor appears twice in one call")
        seen.add((w.data_ptr(), g.rows, g.cols))
        checked.append((w, key, g, code))
        if scales is None:
            bits.append(ONE_BITS)
            continue
        bits.append(int(np.float32(check_scale(f"scales[{k}]", scales[k])).view(np.int32)))
    check_disjoint(checked)
    return checked, bits, be, device


def _compiling() -> bool:
    """True while torch.compile traces: the ops then record their ``torch.ops.espert`` operator."""
    return torch.compiler.is_compiling()


def _op_scales(scales) -> list[float] | None:
    return None if scales is None else [check_scale(f"scales[{k}]", s) for k, s in enumerate(scales)]


@torch.no_grad()
def es_update_many_(
    items,
    seeds: Sequence[int],
    coeffs: Sequence[float],
    *,
    noise: str = "gaussian",
    scales: Sequence[float] | None = None,
    backend: str | None = None,
    record: PatchList | None = None,
) -> None:
    """In place, for every ``(w, key, block)`` of ``items``:
    ``w <- round(w + Σ_n c_n · ε(seeds[n], key, logical index))``, one pass per element, with
    ``c_n = fl32(fl32(coeffs[n]) · fl32(scales[t]))`` (scale 1.0, the default, is exact).

    w: float32 / float16 / bfloat16, [rows, cols] (unit inner stride), [n] or contiguous N-D, all on
    one device; key: int in [0, 2^64); block: :class:`Block` or None.  seeds: N ints in [0, 2^64);
    coeffs: N finite floats.  noise: ``"gaussian"`` (v1), ``"gaussian-icdf"``, ``"rademacher"`` or ``"lowrank:r"``
    (docs/noise.md §5; 1-row parameters take the Gaussian).  Everything is validated before any
    write; one launch plan serves the whole list (module docstring).  record: a
    :class:`~espert.ops.patch.PatchList` on the weights' device, to which the elements this call's
    negation would not restore are appended (see :func:`restore_patched_many_`).
    """
    if _compiling():
        if record is not None:
            raise ValueError(
                "record= (restore='patch') does not run inside torch.compile"
            )  # coefficients travel as float64, so the operator checks what this call would
        s = torch.tensor([as_int64(v, f"seeds[{i}]") for i, v in enumerate(seeds)], dtype=torch.int64)
        c = torch.tensor([float(v) for v in coeffs], dtype=torch.float64)
        torch.ops.espert.es_update_(*op_args(items), s, c, _op_scales(scales), noise, backend)
        return
    fam = NoiseFamily.parse(noise)
    seed_arr, coeff32 = check_members(seeds, coeffs)
    checked, scale_bits, be, device = _check_items(items, fam, len(seed_arr), scales, backend)
    if record is not None:
        _check_record(record, device, be)
    if not checked or len(seed_arr) == 0:
        return
    steps = build_steps(checked, fam, len(seed_arr), scale_bits, device, be.unit_groups and be.unit_groups())
    if steps:
        be.run(device, steps, seed_arr, coeff32, record)
    # in-place edits must be visible to autograd, as torch's own in-place ops are
    torch.autograd.graph.increment_version([w for w, _, _, _ in checked])


def perturb_many_(
    items,
    seed: int,
    sigma: float,
    sign: int = 1,
    *,
    noise: str = "gaussian",
    scales: Sequence[float] | None = None,
    backend: str | None = None,
    record: PatchList | None = None,
) -> None:
    """In place, for every ``(w, key, block)``: ``w <- round(w + c·ε(seed, key, index))`` with
    ``c = fl32(fl32(sign·σ)·scale)``.  σ: finite, > 0 and normal in float32; sign: the int +1 or -1.
    See :func:`es_update_many_` for the tensors, ``noise`` and ``record``."""
    sigma = check_sigma(sigma)
    sign = check_sign(sign)
    if _compiling() and record is None:
        seed = as_int64(seed, "seeds[0]")
        torch.ops.espert.perturb_(*op_args(items), seed, sigma, sign, _op_scales(scales), noise, backend)
        return
    es_update_many_(items, [seed], [sign * sigma], noise=noise, scales=scales, backend=backend, record=record)


def _check_record(record, device, be) -> None:
    if not isinstance(record, PatchList):
        raise TypeError(f"record must be an espert.ops.patch.PatchList, got {type(record).__name__}")
    if record.device != device:
        raise ValueError(f"the patch list is on {record.device}; the weights are on {device}")
    if be.write_patch is None:
        raise ValueError(f"backend {be.name!r} cannot record a patch list")


@torch.no_grad()
def restore_patched_many_(
    items,
    seed: int,
    sigma: float,
    sign: int,
    record: PatchList,
    *,
    noise: str = "gaussian",
    scales: Sequence[float] | None = None,
    backend: str | None = None,
) -> bool:
    """Undo ``perturb_many_(items, seed, sigma, sign, record=record, ...)`` exactly, in place: the same
    call with ``-sign``, then the recorded elements written back (:mod:`espert.ops.patch`).  The
    arguments must be the recorded call's, and ``record`` cleared before it.  Returns False, writing
    nothing, when the list overflowed its capacity (then restore from the center instead)."""
    sigma = check_sigma(sigma)
    sign = check_sign(sign)
    fam = NoiseFamily.parse(noise)
    checked, _, be, device = _check_items(items, fam, 1, scales, backend)
    _check_record(record, device, be)
    n = record.misses()
    if n > record.capacity:
        return False
    es_update_many_(items, [seed], [-sign * sigma], noise=noise, scales=scales, backend=backend)
    if n:
        be.write_patch(device, record, n)
    torch.autograd.graph.increment_version([w for w, _, _, _ in checked])
    return True


def es_update_(
    w: torch.Tensor,
    seeds: Sequence[int],
    coeffs: Sequence[float],
    key: int,
    *,
    block: Block | None = None,
    backend: str | None = None,
    master: torch.Tensor | None = None,
    noise: str = "gaussian",
):
    """In place: ``w <- round(w + Σ_n coeffs[n] · ε(seeds[n], key, logical index))``, one pass.

    A registered weight type (:func:`register_weight_type`; ``espert.quant.QuantWeight``) dispatches
    to its own implementation (quantized: the lattice kernels, ``master`` its optional float32
    code-domain master).

    w: float32 / float16 / bfloat16 on cpu or cuda, shape [rows, cols] (unit inner stride), [n] or
    contiguous N-D.  seeds: N ints in [0, 2^64).  coeffs: N finite floats (rounded to float32).
    The sum over members is taken in float32 registers in member order; each element of ``w`` is
    read and written once, and nothing of size N × w is stored.  ``noise``: see
    :func:`es_update_many_`, of which this is the one-tensor case.  Returns ``w``.
    """
    impl = _weight_type(w)
    if impl is not None:
        return impl.update(w, seeds, coeffs, key, block=block, backend=backend, master=master, noise=noise)
    if master is not None:
        raise ValueError("master= is only for quantized weights; float weights keep their master in a CenterStore")
    es_update_many_([(w, key, block)], seeds, coeffs, noise=noise, backend=backend)
    return w


def perturb_(
    w: torch.Tensor,
    seed: int,
    key: int,
    sigma: float,
    sign: int = 1,
    *,
    block: Block | None = None,
    backend: str | None = None,
    noise: str = "gaussian",
) -> torch.Tensor:
    """In place: ``w <- round(w + sign·σ·ε(seed, key, logical index))``.  Antithetic pairs use sign ±1.

    Same tensor rules as :func:`es_update_` (it is ``es_update_`` with one member and coefficient
    ``sign·σ``).  σ must be finite, > 0 and normal in float32; sign the int +1 or -1.  Undo it
    with :func:`restore_`, never by subtracting: rounding makes ``(w + σε) - σε != w`` for a few
    percent of bf16/fp16 elements.
    """
    impl = _weight_type(w)
    if impl is not None:
        return impl.perturb(w, seed, key, sigma, sign, block=block, backend=backend, noise=noise)
    perturb_many_([(w, key, block)], seed, sigma, sign, noise=noise, backend=backend)
    return w


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
    impl = _weight_type(w)
    if impl is not None:
        return impl.restore(w, center)
    if _compiling():
        torch.ops.espert.restore_(w, center, non_blocking)
        return w
    check_weight(w)
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
    g = geometry(w, None)
    if w.numel() == 0:
        return w
    dst = w.as_strided((g.rows, g.cols), (g.row_stride, 1))  # a view: the one geometry all ops use
    src = center.view(g.rows, g.cols)
    step = max(1, plan.STAGING_BYTES // max(1, g.cols * src.element_size()))
    host_narrow = src.dtype != w.dtype and src.device.type == "cpu"
    staging = None
    if host_narrow:
        sync_cpu_threads()
        if w.device.type != "cpu":  # narrow on the host into bounded staging, then one transfer per chunk
            staging = torch.empty(min(g.rows, step) * g.cols, dtype=w.dtype, pin_memory=torch.cuda.is_available())
    for i in range(0, g.rows, step):
        d, s = dst[i : i + step], src[i : i + step]
        if s.dtype == d.dtype:
            d.copy_(s, non_blocking=non_blocking)
        elif host_narrow and staging is None:  # one pass, no temporaries, NaN bits kept
            _C.narrow_f32_cpu(s.data_ptr(), d.data_ptr(), DTYPE_CODES[d.dtype], d.shape[0], g.cols, g.row_stride)
        elif host_narrow:
            h = staging[: s.numel()]
            _C.narrow_f32_cpu(s.data_ptr(), h.data_ptr(), DTYPE_CODES[d.dtype], s.shape[0], g.cols, g.cols)
            d.copy_(h.view(s.shape))
        else:  # a device-side source: torch ops on that device
            cast_exact_(d, s) if s.device == d.device else d.copy_(cast_exact_(torch.empty_like(s, dtype=d.dtype), s))
    return w
