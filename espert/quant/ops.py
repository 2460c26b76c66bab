"""In-place perturb / restore / fused ES update of quantized weights, where they live.

The ops take a :class:`~espert.quant.formats.QuantWeight` (codes in their storage layout, scales)
and edit the codes in place; scales and zero points are never changed.  Noise is the one noise
spec: element (n, k) of the logical ``[N_out, K_in]`` weight gets ε(seed, key, n·K + k) (or its
block's logical index), whatever the layout, so a weight gets the same noise as its float
original.  The per-element math is in ``espert/quant/reference.py`` and docs/quantized.md.

Backends (``backend=None``: ``cpu`` for CPU tensors, ``cuda`` (else ``triton``) for CUDA ones):

    reference  numpy: unpack -> float -> edit -> repack (slow, obviously correct)
    cpu        C++ / OpenMP, espert._C.quant_cpu (csrc/cpu/quant_cpu.cpp)
    cuda       espert._C.quant_cuda (csrc/cuda/quant_cuda.cu), when built with nvcc
    triton     espert/kernels/quant.py (GPU; CPU tensors only under TRITON_INTERPRET=1)

Every argument is validated before any backend touches memory: an error leaves codes and
master untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from espert import _C, noise, ops
from espert.noise import NoiseFamily
from espert.ops import plan, sync_cpu_threads
from espert.ops.backends import select as select_backend
from espert.ops.backends import upload
from espert.ops.checks import U64, Block, check_members, check_sigma, check_sign, check_u64

from . import reference as ref
from .formats import FORMATS, SCALE_DTYPES, QuantWeight, marlin_grouped, nk_view, storage_shape

# The codes the kernels switch on are defined once, in C++ (csrc/quant.h), and exported by _C.
ELEM_CODES = dict(_C.QUANT_ELEM_CODES)
LAYOUT_CODES = dict(_C.QUANT_LAYOUT_CODES)
SCALE_KINDS = dict(_C.QUANT_SCALE_KIND_CODES)
SCALE_DTYPE_CODES = ops.DTYPE_CODES
MODES = dict(_C.QUANT_MODE_CODES)
STORAGE_LIMITS = {"int8": (-128, 127), "fp8": (-448.0, 448.0), "int4": (0, 15)}


@dataclass(frozen=True)
class QGeometry:
    """What the kernels need besides pointers: validated layout, shape, strides, scales, block."""

    elem: str
    layout: str
    N: int
    K: int
    ld: int
    row_offset: int
    col_offset: int
    logical_cols: int
    scale_kind: str
    group: int
    scale_ld: int
    qmin: float
    qmax: float
    data: torch.Tensor  # the tensor whose data_ptr the kernels get (8-bit: uint8 view)
    logical_rows: int


@dataclass(frozen=True)
class QNoise:
    """The noise of one call as the kernels take it: the family name (``"lowrank"`` only on parameters
    with more than one logical row) and, for lowrank, r and the block's staged factors made by the
    float kernels (``stage`` keeps them alive; A' [n, N, r] at address ``stage_a``, Bᵀ [n, r, K] at
    ``stage_b``; the reference backend computes them itself and stages nothing)."""

    family: str
    rank: int = 0
    stage: torch.Tensor | None = None
    stage_a: int = 0
    stage_b: int = 0


def _err(qw: QuantWeight, msg: str) -> ValueError:
    return ValueError(f"quantized weight ({qw.fmt}, [{qw.out_features}, {qw.in_features}]): {msg}")


def qgeometry(qw: QuantWeight, block: Block | None = None) -> QGeometry:
    """Validate ``qw`` (format, storage dtype/shape/strides, scales, group size, code range, block).

    Raises TypeError / ValueError with a message naming what is wrong; touches nothing.
    """
    if not isinstance(qw, QuantWeight):
        raise TypeError(f"expected a QuantWeight, got {type(qw).__name__}")
    if qw.fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {qw.fmt!r}; supported: {FORMATS}")
    N, K = int(qw.out_features), int(qw.in_features)
    if N <= 0 or K <= 0:
        raise _err(qw, "out_features and in_features must be positive")
    if K % 4:
        raise _err(qw, f"in_features must be a multiple of 4 (noise groups are 4 consecutive k), got {K}")
    if not isinstance(qw.qweight, torch.Tensor):
        raise TypeError(f"qweight must be a torch.Tensor, got {type(qw.qweight).__name__}")
    storage = _int4_storage if qw.elem == "int4" else _byte_storage
    layout, ld, data, kind, g, scale_ld = storage(qw, N, K)
    _check_scales(qw)
    _check_zeros(qw, N, K // g)
    qmin, qmax = _code_range(qw)
    b = block or Block()
    lr = N if b.logical_rows is None else b.logical_rows
    lc = K if b.logical_cols is None else b.logical_cols
    ro, co = b.row_offset, b.col_offset
    if min(ro, co) < 0 or ro + N > lr or co + K > lc:
        raise _err(qw, f"block at offset ({ro}, {co}) lies outside the logical shape [{lr}, {lc}]")
    if lr * lc >= U64:
        raise _err(qw, f"logical shape [{lr}, {lc}] has more than 2^64 elements")
    if lc % 4 or co % 4:
        raise _err(qw, f"blocks need logical_cols and col_offset divisible by 4, got {lc} and {co}")
    return QGeometry(qw.elem, layout, N, K, ld, ro, co, lc, kind, g, scale_ld, qmin, qmax, data, lr)


def _int4_storage(qw: QuantWeight, N: int, K: int) -> tuple:
    """``(layout, ld, data, scale kind, group, scale_ld)`` of a packed int4 weight (gptq, awq, cpu_w4a16, marlin)."""
    q = qw.qweight
    if q.dtype != torch.int32:
        raise _err(qw, f"qweight must be int32 (8 packed 4-bit codes per word), got {q.dtype}")
    need = {
        "gptq": (K % 8 == 0, "in_features % 8 == 0"),
        "awq": (N % 8 == 0, "out_features % 8 == 0"),
        "cpu_w4a16": (N % 16 == 0, "out_features % 16 == 0"),
        "marlin": (K % 16 == 0 and N % 64 == 0, "in_features % 16 == 0 and out_features % 64 == 0"),
    }[qw.fmt]
    if not need[0]:
        raise _err(qw, f"the {qw.fmt} layout needs {need[1]}")
    shape = storage_shape(qw.fmt, N, K)
    if tuple(q.shape) != shape:
        raise _err(qw, f"{qw.fmt} qweight must have shape {list(shape)}, got {list(q.shape)}")
    ld = q.stride(0) if shape[0] > 1 else shape[1]  # a column slice of wider storage (a fused layer's piece)
    if (shape[1] > 1 and q.stride(1) != 1) or ld < shape[1]:
        raise _err(qw, f"qweight must be row-major (rows contiguous, any row stride), got strides {q.stride()}")
    g = qw.group
    if qw.group_size not in (-1, None) and (g <= 0 or K % g or g % 8):
        raise _err(
            qw,
            f"unsupported group_size {qw.group_size}: use -1 or a positive multiple of 8 that divides in_features ({K})",
        )
    if qw.fmt == "marlin" and qw.group_size not in (-1, None) and g % 16:
        raise _err(qw, f"marlin needs group_size -1 or a multiple of 16, got {qw.group_size}")
    if tuple(qw.scales.shape) != (K // g, N):
        raise _err(qw, f"scales must have shape [{K // g}, {N}] ([K/group_size, N]), got {list(qw.scales.shape)}")
    if qw.fmt == "marlin":
        kind = "marlin_grouped" if marlin_grouped(qw.group_size, K) else "marlin_channel"
    else:
        kind = "grouped"
    return qw.fmt, ld, q, kind, g, N


def _byte_storage(qw: QuantWeight, N: int, K: int) -> tuple:
    """``(layout, ld, data, scale kind, group, scale_ld)`` of an int8 or FP8 weight, [N, K] or [K, N] row-major."""
    q = qw.qweight
    want = torch.int8 if qw.elem == "int8" else torch.float8_e4m3fn
    if q.dtype != want:
        raise _err(qw, f"qweight must be {want}, got {q.dtype}")
    if q.dim() != 2:
        raise _err(qw, f"qweight must be 2-D, got shape {list(q.shape)}")
    t = nk_view(qw)
    if tuple(t.shape) != (N, K):
        exp = [K, N] if qw.transposed else [N, K]
        raise _err(qw, f"qweight must have shape {exp} (transposed={qw.transposed}), got {list(q.shape)}")
    if t.stride(1) == 1 and (N == 1 or t.stride(0) >= K):
        layout, ld = "nk", (t.stride(0) if N > 1 else K)
    elif t.stride(0) == 1 and (K == 1 or t.stride(1) >= N):
        layout, ld = "kn", (t.stride(1) if K > 1 else N)
    else:
        raise _err(
            qw,
            f"qweight must be row-major [N, K] or [K, N] with unit inner stride "
            f"(non-contiguous view with strides {q.stride()})",
        )
    s = qw.scales
    if s.numel() == 1:
        kind = "tensor"
    elif s.numel() == N and s.dim() in (1, 2) and s.shape[-1] in (1, N):
        kind = "channel"
    else:
        raise _err(
            qw,
            f"scales must have one element (per tensor) or shape [N] / [N, 1] (per channel, N={N}), got {list(s.shape)}",
        )
    return layout, ld, q.view(torch.uint8) if qw.elem == "fp8" else q, kind, K, 0


def _check_scales(qw: QuantWeight) -> None:
    s = qw.scales
    if not isinstance(s, torch.Tensor) or s.dtype not in SCALE_DTYPES:
        raise _err(
            qw, f"scales must be a float32 / float16 / bfloat16 tensor, got {getattr(s, 'dtype', type(s).__name__)}"
        )
    if not s.is_contiguous():
        raise _err(qw, f"scales must be contiguous, got strides {s.stride()}")
    if s.device != qw.qweight.device:
        raise _err(qw, f"scales are on {s.device} but qweight is on {qw.qweight.device}")
    sf = s.float()
    if not bool(torch.isfinite(sf).all()) or not bool((sf > 0).all()):
        raise _err(qw, "scales must be finite and > 0 (a step of one code must be a finite value step)")


def _check_zeros(qw: QuantWeight, N: int, groups: int) -> None:
    """Only dequantize reads zero points, but a transposed [N, K/g] tensor would be silently wrong."""
    z = qw.zeros
    if z is None:
        return
    if qw.elem != "int4":
        raise _err(qw, "zero points are only defined for int4 formats (int8 / fp8 are symmetric)")
    if not isinstance(z, torch.Tensor) or z.dtype.is_floating_point or z.dtype == torch.bool:
        raise _err(qw, f"zeros must be an integer tensor, got {getattr(z, 'dtype', type(z).__name__)}")
    if tuple(z.shape) != (groups, N):
        raise _err(qw, f"zeros must have shape [{groups}, {N}] ([K/group_size, N], unpacked), got {list(z.shape)}")


def _code_range(qw: QuantWeight) -> tuple[float, float]:
    lo, hi = STORAGE_LIMITS[qw.elem]
    qmin, qmax = qw.code_range
    if not (lo <= qmin <= qmax <= hi) or (qw.elem != "fp8" and (qmin != int(qmin) or qmax != int(qmax))):
        ints = "integers " if qw.elem != "fp8" else ""
        raise _err(qw, f"code range [{qmin}, {qmax}] must be {ints}within [{lo}, {hi}]")
    return float(qmin), float(qmax)


def _check_master(qw: QuantWeight, master: torch.Tensor | None) -> None:
    if master is None:
        return
    if not isinstance(master, torch.Tensor) or master.dtype != torch.float32:
        raise _err(qw, f"master must be a float32 tensor, got {getattr(master, 'dtype', type(master).__name__)}")
    if tuple(master.shape) != qw.shape or not master.is_contiguous():
        raise _err(
            qw,
            f"master must be a contiguous [{qw.out_features}, {qw.in_features}] tensor, got "
            f"{list(master.shape)} strides {master.stride()}",
        )
    if master.device != qw.qweight.device:
        raise _err(qw, f"master is on {master.device} but qweight is on {qw.qweight.device}")
    # a sum is NaN/Inf whenever an element is (masters are small code-domain values: no overflow), and,
    # unlike an elementwise mask, allocates nothing proportional to the weight
    if not math.isfinite(float(master.sum())) and not bool(torch.isfinite(master).all()):
        raise _err(qw, "master holds NaN or Inf (a code-domain master must be finite; its code would be undefined)")


# ---- backends ------------------------------------------------------------------------------


def _quant_row(**fields) -> np.ndarray:
    """One QuantEntry of csrc/quant.h: the int64 row of the fields named in ``_C.QUANT_FIELDS``, every
    one given by name (values >= 2^63 go in as uint64 bit patterns)."""
    names = _C.QUANT_FIELDS
    if set(fields) != set(names):
        raise ValueError(f"quantized kernel row: fields {sorted(set(fields) ^ set(names))} missing or unknown")
    row = np.zeros(len(names), np.int64)
    u = row.view(np.uint64)
    for i, name in enumerate(names):
        v = int(fields[name])
        if v < 0:
            row[i] = v
        else:
            u[i] = v
    return row


def _kernel_args(qw: QuantWeight, g: QGeometry, master, mode: str, qn: QNoise, seeds, coeffs, n, key) -> np.ndarray:
    """The kernels' row (host int64) for one call: seeds / coeffs are the addresses of its n members."""
    return _quant_row(
        codes=g.data.data_ptr(),
        elem=ELEM_CODES[g.elem],
        layout=LAYOUT_CODES[g.layout],
        N=g.N,
        K=g.K,
        ld=g.ld,
        row_offset=g.row_offset,
        col_offset=g.col_offset,
        logical_cols=g.logical_cols,
        scales=qw.scales.data_ptr(),
        scale_dtype=SCALE_DTYPE_CODES[qw.scales.dtype],
        scale_kind=SCALE_KINDS[g.scale_kind],
        group=g.group,
        scale_ld=g.scale_ld,
        master=0 if master is None else master.data_ptr(),
        mode=MODES[mode],
        family=ops.FAMILY_CODES[qn.family],
        rank=qn.rank,
        stage_a=qn.stage_a,
        stage_b=qn.stage_b,
        qmin_bits=np.float32(g.qmin).view(np.int32),
        qmax_bits=np.float32(g.qmax).view(np.int32),
        seeds=seeds,
        coeffs=coeffs,
        n=n,
        key=key,
    )


def _run_cpu(qw, g, master, mode, seeds, coeffs, key, qn):
    sync_cpu_threads()
    row = _kernel_args(qw, g, master, mode, qn, seeds.ctypes.data, coeffs.ctypes.data, len(seeds), key)
    _C.quant_cpu(row.ctypes.data)


def _run_cuda(qw, g, master, mode, seeds, coeffs, key, qn):
    dev = qw.qweight.device
    with torch.cuda.device(dev):  # the kernel launches on the current device: make it the weight's
        st = upload(dev, [], seeds, coeffs)  # one pinned, non-blocking copy (no stream sync)
        row = _kernel_args(qw, g, master, mode, qn, st.seeds.data_ptr(), st.coeffs.data_ptr(), len(seeds), key)
        _C.quant_cuda(row.ctypes.data, torch.cuda.current_stream(dev).cuda_stream)


def _run_triton(qw, g, master, mode, seeds, coeffs, key, qn):
    from espert.kernels.quant import quant_apply

    # the kernel takes the members as arguments (its row's seeds/coeffs columns stay 0), and a perturb reads
    # seeds[0]: an update without members still stages one (the row's n stays 0)
    row = _kernel_args(qw, g, master, mode, qn, 0, 0, len(seeds), key)
    if len(seeds) == 0:
        seeds, coeffs = np.zeros(1, seeds.dtype), np.zeros(1, coeffs.dtype)
    st = upload(qw.qweight.device, [], seeds, coeffs, rows=[row])
    quant_apply(row, st.tables[0], st.seeds, st.coeffs)


def _run_reference(qw, g, master, mode, seeds, coeffs, key, qn):
    from .formats import logical_scales, pack_codes_, unpack_codes

    idx = noise.block_indices((g.N, g.K), g.row_offset, g.col_offset, g.logical_cols)
    codes = unpack_codes(qw).numpy()
    scales = logical_scales(qw).numpy()
    family = f"lowrank:{qn.rank}" if qn.family == "lowrank" else qn.family
    shape = (g.logical_rows, g.logical_cols)
    if mode == "perturb":
        new = ref.perturb_codes(
            codes, g.elem, scales, int(seeds[0]), key, float(coeffs[0]), g.qmin, g.qmax, idx, family=family, shape=shape
        )
    else:
        m = None if master is None else master.detach().cpu().numpy()
        new, m2 = ref.update_codes(
            codes, m, g.elem, scales, seeds, coeffs, key, g.qmin, g.qmax, idx, family=family, shape=shape
        )
        if master is not None:
            master.copy_(torch.from_numpy(m2))
    pack_codes_(qw, torch.from_numpy(new))


# one backend registry for every weight type (espert.ops.BACKENDS; ESPERT_BACKEND picks the default)
for _name, _run in (("cpu", _run_cpu), ("cuda", _run_cuda), ("triton", _run_triton)):
    ops.register_quant_runner(_name, _run)
ops.register_quant_runner("reference", _run_reference, supports=lambda t: t.device.type == "cpu")


def _noise(fam: NoiseFamily, g: QGeometry, key: int, seeds: np.ndarray, device, backend: str) -> QNoise:
    """Validate the call's family for this weight and stage lowrank's factors (before any write)."""
    if fam.name != "lowrank" or g.logical_rows == 1 or len(seeds) == 0:
        # 1-row parameters take the Gaussian (noise.md §5.2); with no member the family does not matter
        return QNoise("gaussian" if fam.name == "lowrank" else fam.name)
    r = fam.rank
    if g.logical_rows * r >= U64 or r * g.logical_cols >= U64:
        raise ValueError(f"{fam} needs logical_rows·r and r·logical_cols below 2^64")
    if 4 * len(seeds) * r * (g.N + g.K) > plan.STAGING_BYTES:
        raise ValueError(
            f"{fam} with {len(seeds)} members on a quantized [{g.N}, {g.K}] block needs more than "
            f"{plan.STAGING_BYTES >> 20} MiB of staging; use fewer members per call"
        )
    if backend == "reference":
        return QNoise("lowrank", r)
    stage, sa, sb = ops.lowrank_stage(
        key, g.N, g.K, g.row_offset, g.col_offset, g.logical_cols, seeds, r, device, backend
    )
    return QNoise("lowrank", r, stage, sa, sb)


def _run(qw: QuantWeight, g: QGeometry, master, mode: str, seeds, coeffs, key: int, fam, backend: str | None):
    be = select_backend(qw.qweight, backend, "quant")
    qn = _noise(fam, g, key, seeds, qw.qweight.device, be.name)
    be.quant(qw, g, master, mode, seeds, coeffs, key, qn)


# ---- the ops -------------------------------------------------------------------------------


@torch.no_grad()
def perturb_q(
    qw: QuantWeight,
    seed: int,
    key: int,
    sigma: float,
    sign: int = 1,
    *,
    block: Block | None = None,
    backend: str | None = None,
    noise: str = "gaussian",
) -> QuantWeight:
    """In place: codes ← clamp(code + floor(sign·σ·ε/s + u)) (int8 / int4) or the e4m3 code nearest
    below/above e4m3(code) + sign·σ·ε/s, chosen stochastically (fp8).  u = sr_uniform(seed, key, i).

    The dequantized step is unbiased: E[Δθ] = sign·σ·ε (before clamping).  Undo with
    ``espert.ops.restore_`` (exact copy of the stored codes), never by a second perturb.  Returns ``qw``.
    Reached through ``espert.ops.perturb_``.
    """
    fam = NoiseFamily.parse(noise)
    sigma = check_sigma(sigma)  # the float ops' rules (espert.ops.checks)
    sign = check_sign(sign)
    g = qgeometry(qw, block)
    key = check_u64("key", key)
    seeds, coeffs = check_members([seed], [sign * sigma])
    _run(qw, g, None, "perturb", seeds, coeffs, key, fam, backend)
    return qw


@torch.no_grad()
def es_update_q(
    qw: QuantWeight,
    seeds: Sequence[int],
    coeffs: Sequence[float],
    key: int,
    *,
    master: torch.Tensor | None = None,
    block: Block | None = None,
    backend: str | None = None,
    noise: str = "gaussian",
) -> QuantWeight:
    """The fused ES update of a quantized weight, in place: θ ← θ + Σ_n coeffs[n]·ε(seeds[n]).

    With ``master`` (float32 [N, K], the code-domain value: int code + residual, or fp8 value / s):
    master ← clamp(master + Σ c ε / s), codes ← round-to-nearest-even(master) — small steps
    accumulate in the master.  Without: codes ← round(code + Σ c ε / s) (naive; small steps vanish).
    All members' noise is regenerated per element in registers; each code (word) is read and written
    once.  Returns ``qw``.  Reached through ``espert.ops.es_update_``.
    """
    fam = NoiseFamily.parse(noise)
    g = qgeometry(qw, block)
    _check_master(qw, master)
    key = check_u64("key", key)
    seed_arr, coeff32 = check_members(seeds, coeffs)
    mode = "master" if master is not None else "naive"
    _run(qw, g, master, mode, seed_arr, coeff32, key, fam, backend)
    return qw


@torch.no_grad()
def requantize_(qw: QuantWeight, master: torch.Tensor, *, backend: str | None = None) -> QuantWeight:
    """codes ← round-to-nearest-even(clamp(master)) (the update with no member): after loading a master."""
    return es_update_q(qw, [], [], 0, master=master, backend=backend)


@torch.no_grad()
def restore_q(qw: QuantWeight, codes: torch.Tensor) -> QuantWeight:
    """In place: the storage ← ``codes`` (same shape and dtype, any device), an exact copy, in row
    chunks of at most 64 MiB (no device allocation beyond what ``copy_`` stages)."""
    q = qw.qweight
    if not isinstance(codes, torch.Tensor) or codes.shape != q.shape or codes.dtype != q.dtype:
        raise _err(
            qw,
            f"restore source must be a {q.dtype} tensor of shape {list(q.shape)}, got "
            f"{getattr(codes, 'dtype', None)} {list(getattr(codes, 'shape', []))}",
        )
    rows_dst = q if q.dim() > 1 else q.unsqueeze(0)
    rows_src = codes.reshape(rows_dst.shape)
    row_bytes = max(1, rows_src.shape[1] * rows_src.element_size())
    step = max(1, plan.STAGING_BYTES // row_bytes)
    for i in range(0, rows_dst.shape[0], step):
        rows_dst[i : i + step].copy_(rows_src[i : i + step])
    return qw


# the one op surface: espert.ops.perturb_ / es_update_ / restore_ dispatch QuantWeight here
ops.register_weight_type(QuantWeight, ops.WeightType(perturb=perturb_q, update=es_update_q, restore=restore_q))
