"""The one op surface: in-place perturb, exact restore and the fused ES update.

Every op validates its arguments completely before any backend touches memory, so a
bad call raises and leaves the weights untouched.  Backends are registered in
``BACKENDS`` with a capability gate; ``backend=None`` picks the default for the
tensor's device (``ESPERT_BACKEND`` overrides it):

    cpu     C++ kernels in espert._C (AVX-512, AVX2 or generic, chosen at run time)
    cuda    CUDA kernels in espert._C (when the module was built with nvcc)
    triton  Triton kernels in kernels/ (GPU; CPU tensors only under TRITON_INTERPRET=1)

All three compute the same bits: see docs/noise.md.  The multi-tensor ops
(:func:`es_update_many_`, :func:`perturb_many_`) take a whole list of tensors and build one launch
plan per call (an int64 table, one row per tensor): one C++ call with one OpenMP region on CPU; on
CUDA and Triton one host-to-device copy of seeds, coefficients and the table, and one launch per
(dtype, family) present.  The single-tensor ops are thin wrappers over them.  ``COUNTERS`` /
:func:`counting` count kernel launches and host-to-device copies.  Quantized weights
(``espert.quant.QuantWeight``: int8, FP8, int4 GPTQ/AWQ/Marlin) go through the same three ops,
dispatched by layout to the lattice kernels of ``espert.quant`` (docs/quantized.md).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from espert import _C
from espert.noise import LOWRANK_KEY_A, LOWRANK_KEY_B, NoiseFamily, lowrank_scale

# Codes come from the compiled module, the one place they are defined (csrc/noise.h, csrc/apply.h).
DTYPE_CODES = {getattr(torch, name): code for name, code in _C.DTYPE_CODES.items()}
FAMILY_CODES = dict(_C.FAMILY_CODES)
PLAN_FIELDS = tuple(_C.PLAN_FIELDS)
_F = {name: i for i, name in enumerate(PLAN_FIELDS)}
U64 = 1 << 64
_ONE_BITS = int(np.float32(1.0).view(np.int32))
_TINY32 = np.finfo(np.float32).tiny
# Bounded temporaries (restore_ conversion, lowrank A/B staging): at most this many bytes at once.
STAGING_BYTES = 64 << 20

# Kernel launches (a CPU call counts as one) and host-to-device copies made by the op layer.
COUNTERS = {"launches": 0, "h2d": 0}


@contextlib.contextmanager
def counting() -> Iterator[dict]:
    """``with ops.counting() as c: ...``: afterwards ``c`` holds the launches and host-to-device copies
    the ops made inside the block (deltas of :data:`COUNTERS`)."""
    start = dict(COUNTERS)
    out = {k: 0 for k in COUNTERS}
    try:
        yield out
    finally:
        out.update({k: COUNTERS[k] - start[k] for k in COUNTERS})


def _as_index(owner: str, name: str, v, optional: bool = False):
    if v is None and optional:
        return None
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{owner}.{name} must be an int, got {v!r} ({type(v).__name__})")
    return int(v)


@dataclass(frozen=True)
class Block:
    """Where a tensor sits inside its logical parameter.

    The tensor (2-D ``[rows, cols]``, or 1-D as one row, or N-D contiguous flattened to
    ``[prod(shape[:-1]), shape[-1]]``) is the block at ``(row_offset, col_offset)`` of a logical
    ``[logical_rows, logical_cols]`` matrix; element (i, j) has logical index
    ``(row_offset + i) * logical_cols + col_offset + j`` and receives that element's noise.
    Fields are ints (numpy integers are converted; floats and bools are refused).
    """

    row_offset: int = 0
    col_offset: int = 0
    logical_rows: int | None = None  # None: the block is the whole logical tensor
    logical_cols: int | None = None

    def __post_init__(self):
        for name in ("row_offset", "col_offset", "logical_rows", "logical_cols"):
            object.__setattr__(self, name, _as_index("Block", name, getattr(self, name), name.startswith("logical")))


@dataclass(frozen=True)
class _Geometry:
    rows: int
    cols: int
    row_stride: int
    row_offset: int
    col_offset: int
    logical_cols: int
    logical_rows: int = 0


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
                f"got shape {tuple(w.shape)} with strides {w.stride()}"
            )
        row_stride = w.stride(0) if rows > 1 else cols
        if rows > 1 and row_stride < cols:
            raise ValueError(f"rows of the tensor overlap in memory (strides {w.stride()})")
    else:
        if not w.is_contiguous():
            raise ValueError(f"espert ops need a contiguous tensor for {w.dim()}-d shapes, got strides {w.stride()}")
        cols = w.shape[-1]
        rows = w.numel() // cols if cols else 0
        row_stride = cols
    if block is None:
        return _Geometry(rows, cols, row_stride, 0, 0, cols, rows)
    if not isinstance(block, Block):
        raise TypeError(f"block must be an espert.ops.Block or None, got {type(block).__name__}")
    lr = rows if block.logical_rows is None else block.logical_rows
    lc = cols if block.logical_cols is None else block.logical_cols
    ro, co = block.row_offset, block.col_offset
    if min(ro, co) < 0 or ro + rows > lr or co + cols > lc:
        raise ValueError(
            f"block of shape [{rows}, {cols}] at offset ({ro}, {co}) lies outside the logical shape [{lr}, {lc}]"
        )
    if lr * lc >= U64:
        raise ValueError(f"logical shape [{lr}, {lc}] has more than 2^64 elements")
    return _Geometry(rows, cols, row_stride, ro, co, lc, lr)


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


def _check_sigma(sigma) -> float:
    if (
        isinstance(sigma, (bool, np.bool_))
        or not isinstance(sigma, (int, float, np.floating, np.integer))
        or not math.isfinite(sigma)
        or sigma <= 0
    ):
        raise ValueError(f"sigma must be a finite number > 0, got {sigma!r}")
    s32 = np.float32(sigma)
    if not np.isfinite(s32) or s32 < _TINY32:
        raise ValueError(f"sigma {sigma!r} is 0, subnormal or infinite in float32 (the kernels' precision)")
    return float(sigma)


def _check_sign(sign) -> int:
    if type(sign) is not int or sign not in (1, -1):
        raise ValueError(f"sign must be the int +1 or -1, got {sign!r} ({type(sign).__name__})")
    return sign


# ---- backends ------------------------------------------------------------------------------


@dataclass
class _Step:
    """One kernel pass of a call: ``table`` (int64 [E, len(PLAN_FIELDS)]) run with the call's
    coefficients, or with ones (``ones``: the lowrank staging fill); ``groups``: [e0, e1) ranges that
    share a dtype and a family (one GPU launch each); ``zero``: a staging buffer cleared first."""

    table: np.ndarray
    ones: bool
    groups: list
    zero: torch.Tensor | None = None


@dataclass(frozen=True)
class Backend:
    """A kernel backend: one entry serves every weight type.  ``run`` executes float launch plans;
    ``quant`` (filled in by :mod:`espert.quant.ops`) runs the quantized lattice kernels; either may be
    None where the backend has no such kernels (``reference`` is quantized-only)."""

    name: str
    supports: Callable[[torch.Tensor], bool]  # capability gate, on the (storage) tensor
    run: Callable | None  # (device, steps, seeds uint64 [N], coeffs float32 [N]) -> None
    unit_groups: Callable[[], int] | None = None  # GPU: Philox groups per launch unit (None: CPU tiles itself)
    quant: Callable | None = None  # (qw, geometry, master, mode, seeds, coeffs, key, family name) -> None


def sync_cpu_threads() -> None:
    """Give espert's CPU kernels torch's thread count (they run on a separate OpenMP runtime)."""
    _C.set_num_threads(torch.get_num_threads())


def _run_cpu(device, steps: list[_Step], seeds: np.ndarray, coeffs: np.ndarray) -> None:
    sync_cpu_threads()
    ones = np.ones(len(coeffs), np.float32)
    for st in steps:
        if st.zero is not None:
            st.zero.zero_()
        c = ones if st.ones else coeffs
        COUNTERS["launches"] += 1
        _C.apply_many_cpu(st.table.ctypes.data, len(st.table), seeds.ctypes.data, c.ctypes.data, len(seeds))


def _upload(device, steps: list[_Step], seeds: np.ndarray, coeffs: np.ndarray):
    """Seeds, coefficients, ones and every step's table in ONE host-to-device copy.
    Returns (seeds int64, coeffs float32, ones float32, [table int64 [E, F]]) device views."""
    n = len(seeds)
    half = (n + 1) // 2  # two float32 per int64 slot
    fl = np.zeros(2 * half, np.float32)
    fl[:n] = coeffs
    one = np.zeros(2 * half, np.float32)
    one[:n] = 1.0
    parts = [seeds.view(np.int64), fl.view(np.int64), one.view(np.int64)] + [st.table.reshape(-1) for st in steps]
    host = torch.from_numpy(np.concatenate(parts))
    if device.type == "cuda":
        host = host.pin_memory()
    COUNTERS["h2d"] += 1
    dev = host.to(device, non_blocking=True)
    s = dev[:n]
    c = dev[n : n + half].view(torch.float32)[:n]
    o = dev[n + half : n + 2 * half].view(torch.float32)[:n]
    tables, at = [], n + 2 * half
    for st in steps:
        tables.append(dev[at : at + st.table.size].view(st.table.shape))
        at += st.table.size
    return s, c, o, tables


def _run_cuda(device, steps: list[_Step], seeds: np.ndarray, coeffs: np.ndarray) -> None:
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        s, c, o, tables = _upload(device, steps, seeds, coeffs)
        for st, dt in zip(steps, tables):
            if st.zero is not None:
                st.zero.zero_()
            for e0, e1 in st.groups:
                COUNTERS["launches"] += 1
                _C.apply_many_cuda(
                    st.table[e0:].ctypes.data,
                    dt[e0].data_ptr(),
                    e1 - e0,
                    len(seeds),
                    s.data_ptr(),
                    (o if st.ones else c).data_ptr(),
                    stream,
                )


def _run_triton(device, steps: list[_Step], seeds: np.ndarray, coeffs: np.ndarray) -> None:
    from espert.kernels.apply import apply_many

    for st in steps:  # the codes are checked by C++ here too: one rule for every backend
        _C.check_plan(st.table.ctypes.data, len(st.table), len(seeds))
    ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        s, c, o, tables = _upload(device, steps, seeds, coeffs)
        for st, dt in zip(steps, tables):
            if st.zero is not None:
                st.zero.zero_()
            for e0, e1 in st.groups:
                COUNTERS["launches"] += 1
                apply_many(st.table[e0:e1], dt[e0:e1], s, o if st.ones else c)


def _triton_ok(w: torch.Tensor) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return w.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _triton_block() -> int:
    from espert.kernels.apply import DEFAULT_BLOCK

    return DEFAULT_BLOCK


BACKENDS: dict[str, Backend] = {
    "cpu": Backend("cpu", lambda w: w.device.type == "cpu", _run_cpu),
    "cuda": Backend("cuda", lambda w: w.is_cuda and bool(_C.has_cuda), _run_cuda, lambda: int(_C.CUDA_UNIT_GROUPS)),
    "triton": Backend("triton", _triton_ok, _run_triton, _triton_block),
}


def register_quant_runner(name: str, quant: Callable, supports: Callable[[torch.Tensor], bool] | None = None) -> None:
    """Attach the quantized kernels of backend ``name`` (a new backend needs ``supports``)."""
    from dataclasses import replace

    if name in BACKENDS:
        BACKENDS[name] = replace(BACKENDS[name], quant=quant)
    else:
        BACKENDS[name] = Backend(name, supports, None, quant=quant)


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


def available_backends(w: torch.Tensor, kind: str = "run") -> list[str]:
    """Names of the backends whose capability gate accepts ``w`` and that have ``kind`` kernels
    (``"run"``: float, ``"quant"``: quantized)."""
    return [name for name, b in BACKENDS.items() if getattr(b, kind) is not None and b.supports(w)]


def _backend(w: torch.Tensor, name: str | None, kind: str = "run") -> Backend:
    """The backend named (or the default, ``ESPERT_BACKEND`` first) for storage tensor ``w``."""
    name = name or default_backend(w)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}")
    b = BACKENDS[name]
    if getattr(b, kind) is None:
        what = "float" if kind == "run" else "quantized"
        raise ValueError(f"backend {name!r} has no {what} kernels; available: {available_backends(w, kind)}")
    if not b.supports(w):
        raise ValueError(
            f"backend {name!r} cannot run on a {w.device} tensor here; available: {available_backends(w, kind)}"
        )
    return b


# ---- launch plans ----------------------------------------------------------------------------

_I64 = np.int64


def _i64(v: int) -> int:
    """A uint64 value as the int64 with the same bits (the plan table is int64)."""
    return v - U64 if v >= 1 << 63 else v


def _row(
    data, code, rows, cols, row_stride, ro, co, lc, key, scale_bits, family, rank=0, sa=0, sb=0, mb=0, me=0
) -> list:
    return [
        data,
        code,
        rows,
        cols,
        row_stride,
        _i64(ro),
        _i64(co),
        _i64(lc),
        _i64(key),
        scale_bits,
        family,
        rank,
        sa,
        sb,
        mb,
        me,
        0,
        0,
    ]


def _collapse_rows(t: np.ndarray) -> None:
    """In place: a Philox-family entry whose rows are contiguous in memory and in the logical matrix
    (full-width rows, row stride = cols) becomes one long row: fewer row ends, same logical indices."""
    u = t.view(np.uint64)
    m = (
        (t[:, _F["family"]] != FAMILY_CODES["lowrank"])
        & (t[:, _F["rows"]] > 1)
        & (t[:, _F["row_stride"]] == t[:, _F["cols"]])
        & (t[:, _F["col_offset"]] == 0)
        & (u[:, _F["logical_cols"]] == u[:, _F["cols"]])
    )
    if not m.any():
        return
    start = u[m, _F["row_offset"]] * u[m, _F["logical_cols"]]  # < 2^64: checked by _geometry
    n = t[m, _F["rows"]] * t[m, _F["cols"]]
    t[m, _F["rows"]] = 1
    t[m, _F["cols"]] = n
    t[m, _F["row_stride"]] = n
    u[m, _F["row_offset"]] = 0
    u[m, _F["col_offset"]] = start
    u[m, _F["logical_cols"]] = start + n.astype(np.uint64)


def _finish(t: np.ndarray, unit_groups: int | None) -> tuple[np.ndarray, list]:
    """Collapse rows, sort by (family, dtype) and, for GPU backends, fill units_per_row / unit_start
    per launch group.  Returns (table, [(e0, e1)] groups)."""
    if len(t) == 0:
        return t, []
    _collapse_rows(t)
    t = t[np.lexsort((t[:, _F["dtype"]], t[:, _F["family"]]))]
    key = t[:, _F["family"]] * 16 + t[:, _F["dtype"]]
    cuts = [0] + (np.flatnonzero(np.diff(key)) + 1).tolist() + [len(t)]
    groups = list(zip(cuts[:-1], cuts[1:]))
    if unit_groups:
        cols, fam = t[:, _F["cols"]], t[:, _F["family"]]
        lowrank = fam == FAMILY_CODES["lowrank"]
        rademacher = fam == FAMILY_CODES["rademacher"]  # units of whole 128-element Philox calls
        groups_per_row = np.where(
            lowrank, (cols + 3) // 4, np.where(rademacher, 32 * ((cols + 254) // 128), (cols + 6) // 4)
        )
        upr = np.maximum(1, (groups_per_row + unit_groups - 1) // unit_groups)
        t[:, _F["units_per_row"]] = upr
        units = np.where(t[:, _F["member_end"]] > t[:, _F["member_begin"]], t[:, _F["rows"]] * upr, 0)
        for e0, e1 in groups:
            t[e0:e1, _F["unit_start"]] = np.concatenate([[0], np.cumsum(units[e0:e1])[:-1]])
    return np.ascontiguousarray(t), groups


def _lowrank_pieces(g: _Geometry, w: torch.Tensor, n: int, r: int) -> list[tuple]:
    """Split a lowrank block into sub-blocks whose A/B staging (n·r·(rows + cols) float32) fits
    STAGING_BYTES: (data address, rows, cols, row_offset, col_offset) each."""
    budget = STAGING_BYTES // 4
    if n * r * (g.rows + g.cols) <= budget:
        return [(w.data_ptr(), g.rows, g.cols, g.row_offset, g.col_offset)]
    cc = min(g.cols, max(1, (budget // 2) // (n * r)))
    rc = min(g.rows, max(1, (budget - n * r * cc) // (n * r)))
    es, out = w.element_size(), []
    for i0 in range(0, g.rows, rc):
        for j0 in range(0, g.cols, cc):
            out.append(
                (
                    w.data_ptr() + (i0 * g.row_stride + j0) * es,
                    min(rc, g.rows - i0),
                    min(cc, g.cols - j0),
                    g.row_offset + i0,
                    g.col_offset + j0,
                )
            )
    return out


def _build_steps(
    checked: list, fam: NoiseFamily, n: int, scale_bits: list, device, unit_groups: int | None
) -> list[_Step]:
    """The launch plan of one call: the Philox-family entries in one step; lowrank entries in chunks
    whose staging fits STAGING_BYTES, each a fill step (A and Bᵀ from the v1 Gaussian) + an apply step."""
    lr_code = FAMILY_CODES["lowrank"]
    plain, pieces = [], []
    for (w, key, g, code), sb in zip(checked, scale_bits):
        if g.rows == 0 or g.cols == 0:
            continue
        if fam.name == "lowrank" and g.logical_rows > 1:
            for data, rows, cols, ro, co in _lowrank_pieces(g, w, n, fam.rank):
                pieces.append(
                    _row(
                        data,
                        code,
                        rows,
                        cols,
                        g.row_stride,
                        ro,
                        co,
                        g.logical_cols,
                        key,
                        sb,
                        lr_code,
                        fam.rank,
                        mb=0,
                        me=n,
                    )
                )
            continue
        plain.append(
            (w.data_ptr(), code, g.rows, g.cols, g.row_stride, g.row_offset, g.col_offset, g.logical_cols, key, sb)
        )
    steps = []
    if plain:  # column by column: the uint64 fields go in through a uint64 view of the table
        t = np.zeros((len(plain), len(PLAN_FIELDS)), _I64)
        cols = list(zip(*plain))
        for name, col in zip(("data", "dtype", "rows", "cols", "row_stride"), cols[:5]):
            t[:, _F[name]] = col
        for name, col in zip(("row_offset", "col_offset", "logical_cols", "key"), cols[5:9]):
            t.view(np.uint64)[:, _F[name]] = np.array(col, dtype=np.uint64)
        t[:, _F["scale_bits"]] = cols[9]
        t[:, _F["family"]] = FAMILY_CODES["rademacher" if fam.name == "rademacher" else "gaussian"]
        t[:, _F["member_end"]] = n
        t, groups = _finish(t, unit_groups)
        steps.append(_Step(t, False, groups))
    if not pieces:
        return steps
    r = fam.rank
    budget = STAGING_BYTES // 4
    sizes = [n * r * (p[_F["rows"]] + p[_F["cols"]]) for p in pieces]
    chunks, cur, used = [], [], 0
    for p, sz in zip(pieces, sizes):
        if cur and used + sz > budget:
            chunks.append(cur)
            cur, used = [], 0
        cur.append(p)
        used += sz
    chunks.append(cur)
    stage = torch.empty(
        max(sum(n * r * (p[_F["rows"]] + p[_F["cols"]]) for p in c) for c in chunks), dtype=torch.float32, device=device
    )
    for chunk in chunks:
        t = np.array(chunk, dtype=_I64)
        steps.append(_lowrank_fill_step(t, n, r, stage, unit_groups))
        at, ag = _finish(t, unit_groups)
        steps.append(_Step(at, False, ag))
    return steps  # the fill steps hold the staging buffer (zero=stage) until the call returns


def _lowrank_fill_step(t: np.ndarray, n: int, r: int, stage: torch.Tensor, unit_groups: int | None) -> _Step:
    """The fill step of lowrank plan entries ``t`` (int64 [E, len(PLAN_FIELDS)]: rows, cols, offsets,
    logical_cols, key): lays out each entry's A' [n, rows, r] then Bᵀ [n, r, cols] (float32) in ``stage``
    from its start, writes their addresses into t's stage_a / stage_b, and returns the Gaussian step
    that fills them (run with coefficients 1): A' = K_r·ε_v1(key ^ LOWRANKA) of the logical [R, r]
    matrix's rows, Bᵀ = ε_v1(key ^ LOWRANKB) of the logical [r, C] matrix's columns."""
    k_bits = int(lowrank_scale(r).view(np.int32))
    f32, gauss = DTYPE_CODES[torch.float32], FAMILY_CODES["gaussian"]
    members = np.arange(n, dtype=_I64)
    u = t.view(np.uint64)
    rows, cols = t[:, _F["rows"]], t[:, _F["cols"]]
    size = n * r * (rows + cols)
    sa = stage.data_ptr() + 4 * (np.cumsum(size) - size)  # [N, rows, r] A' then [N, r, cols] Bᵀ per piece
    sb = sa + 4 * n * rows * r
    t[:, _F["stage_a"]], t[:, _F["stage_b"]] = sa, sb
    # fill entries, piece-major then member: A' (K_r·ε_v1 of [R, r]) and Bᵀ (ε_v1 of [r, C])
    fills = []
    for is_a in (True, False):
        f = np.zeros((len(t), n, len(PLAN_FIELDS)), _I64)
        fu = f.view(np.uint64)
        f[..., _F["dtype"]], f[..., _F["family"]] = f32, gauss
        f[..., _F["member_begin"]], f[..., _F["member_end"]] = members, members + 1
        if is_a:
            f[..., _F["data"]] = sa[:, None] + 4 * rows[:, None] * r * members
            f[..., _F["rows"]], f[..., _F["cols"]], f[..., _F["row_stride"]] = rows[:, None], r, r
            fu[..., _F["row_offset"]] = u[:, _F["row_offset"], None]
            fu[..., _F["logical_cols"]] = r
            fu[..., _F["key"]] = u[:, _F["key"], None] ^ np.uint64(LOWRANK_KEY_A)
            f[..., _F["scale_bits"]] = k_bits
        else:
            f[..., _F["data"]] = sb[:, None] + 4 * r * cols[:, None] * members
            f[..., _F["rows"]], f[..., _F["cols"]], f[..., _F["row_stride"]] = r, cols[:, None], cols[:, None]
            fu[..., _F["col_offset"]] = u[:, _F["col_offset"], None]
            fu[..., _F["logical_cols"]] = u[:, _F["logical_cols"], None]
            fu[..., _F["key"]] = u[:, _F["key"], None] ^ np.uint64(LOWRANK_KEY_B)
            f[..., _F["scale_bits"]] = _ONE_BITS
        fills.append(f.reshape(-1, len(PLAN_FIELDS)))
    ft, fg = _finish(np.concatenate(fills), unit_groups)
    return _Step(ft, True, fg, zero=stage)


def lowrank_stage(
    key: int,
    rows: int,
    cols: int,
    row_offset: int,
    col_offset: int,
    logical_cols: int,
    seeds: np.ndarray,
    rank: int,
    device,
    backend: str,
) -> tuple[torch.Tensor, int, int]:
    """The lowrank:``rank`` factors of one [rows, cols] block at (row_offset, col_offset) of a logical
    [R, logical_cols] parameter with key ``key``, for members ``seeds`` (uint64 [N]), made by the float
    kernels of ``backend`` on ``device`` (the staging the float path uses; quantized weights read it).
    Returns (stage float32 [N·r·(rows + cols)], address of A' [N, rows, r], address of Bᵀ [N, r, cols]):
    A' = fl(K_r·A) of the block's rows, Bᵀ of its columns.  The caller keeps ``stage`` alive."""
    n = len(seeds)
    t = np.array(
        [
            _row(
                0,
                DTYPE_CODES[torch.float32],
                rows,
                cols,
                cols,
                row_offset,
                col_offset,
                logical_cols,
                key,
                _ONE_BITS,
                FAMILY_CODES["lowrank"],
                rank,
                mb=0,
                me=n,
            )
        ],
        dtype=_I64,
    )
    stage = torch.empty(n * rank * (rows + cols), dtype=torch.float32, device=device)
    be = BACKENDS[backend]
    step = _lowrank_fill_step(t, n, rank, stage, be.unit_groups and be.unit_groups())
    be.run(device, [step], seeds, np.ones(n, np.float32))
    return stage, int(t[0, _F["stage_a"]]), int(t[0, _F["stage_b"]])


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
        raise ValueError(
            f"coefficients must be finite; got {coeff_arr[bad][:4].tolist()} "
            f"at positions {np.flatnonzero(bad)[:4].tolist()}"
        )
    with np.errstate(over="ignore"):  # overflow is reported just below
        coeff32 = coeff_arr.astype(np.float32)
    if not np.isfinite(coeff32).all():
        raise ValueError("coefficients overflow float32")
    return seed_arr, coeff32


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
        code = _check_weight(w)
        key = _check_u64(f"items[{k}] key", key)
        g = _geometry(w, block)
        if fam.name == "lowrank" and g.logical_rows > 1:
            if g.logical_rows * fam.rank >= U64 or fam.rank * g.logical_cols >= U64:
                raise ValueError(f"items[{k}]: {fam} needs logical_rows·r and r·logical_cols below 2^64")
            if n * fam.rank * 8 > STAGING_BYTES:
                raise ValueError(
                    f"{fam} with {n} members needs more than {STAGING_BYTES >> 20} MiB of staging "
                    f"per row and column; use fewer members per call"
                )
        if be is None:
            be, device = _backend(w, backend), w.device
        elif w.device != device:  # one device per call, so one backend
            raise ValueError(f"items[{k}] is on {w.device}; a call takes tensors of one device ({device})")
        if w.numel() and (w.data_ptr(), g.rows, g.cols) in seen:
            raise ValueError(f"items[{k}]: the same tensor appears twice in one call")
        seen.add((w.data_ptr(), g.rows, g.cols))
        checked.append((w, key, g, code))
        if scales is None:
            bits.append(_ONE_BITS)
            continue
        s = scales[k]
        if (
            isinstance(s, (bool, np.bool_))
            or not isinstance(s, (int, float, np.floating, np.integer))
            or not math.isfinite(s)
            or s <= 0
            or not np.float32(s) >= _TINY32
            or not np.isfinite(np.float32(s))
        ):
            raise ValueError(f"scales[{k}] must be a finite number > 0 that is normal in float32, got {s!r}")
        bits.append(int(np.float32(s).view(np.int32)))
    return checked, bits, be, device


@torch.no_grad()
def es_update_many_(
    items,
    seeds: Sequence[int],
    coeffs: Sequence[float],
    *,
    noise: str = "gaussian",
    scales: Sequence[float] | None = None,
    backend: str | None = None,
) -> None:
    """In place, for every ``(w, key, block)`` of ``items``:
    ``w <- round(w + Σ_n c_n · ε(seeds[n], key, logical index))``, one pass per element, with
    ``c_n = fl32(fl32(coeffs[n]) · fl32(scales[t]))`` (scale 1.0, the default, is exact).

    w: float32 / float16 / bfloat16, [rows, cols] (unit inner stride), [n] or contiguous N-D, all on
    one device; key: int in [0, 2^64); block: :class:`Block` or None.  seeds: N ints in [0, 2^64);
    coeffs: N finite floats.  noise: ``"gaussian"`` (v1), ``"rademacher"`` or ``"lowrank:r"``
    (docs/noise.md §5; 1-row parameters take the Gaussian).  Everything is validated before any
    write; one launch plan serves the whole list (module docstring).
    """
    fam = NoiseFamily.parse(noise)
    seed_arr, coeff32 = check_members(seeds, coeffs)
    checked, scale_bits, be, device = _check_items(items, fam, len(seed_arr), scales, backend)
    if not checked or len(seed_arr) == 0:
        return
    steps = _build_steps(checked, fam, len(seed_arr), scale_bits, device, be.unit_groups and be.unit_groups())
    if steps:
        be.run(device, steps, seed_arr, coeff32)
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
) -> None:
    """In place, for every ``(w, key, block)``: ``w <- round(w + c·ε(seed, key, index))`` with
    ``c = fl32(fl32(sign·σ)·scale)``.  σ: finite, > 0 and normal in float32; sign: the int +1 or -1.
    See :func:`es_update_many_` for the tensors and ``noise``."""
    sigma = _check_sigma(sigma)
    sign = _check_sign(sign)
    es_update_many_(items, [seed], [sign * sigma], noise=noise, scales=scales, backend=backend)


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


# ---- torch.library: the same ops as torch operators ------------------------------------------
# torch.compile (fullgraph), CUDA graphs and the profiler see ``torch.ops.espert.*``; the torch-free
# compiled module stays underneath.  The schemas mark the mutated weights (``Tensor(a!)[]``), as
# vLLM's op schemas do, so functionalization knows the weights change in place.  Integers in
# schemas are int64: uint64 seeds and keys travel as their two's-complement bits.  Blocks travel
# flattened, four ints per tensor (row_offset, col_offset, logical_rows, logical_cols), -1 for None.


def _from_i64(v: int) -> int:
    return int(v) & (U64 - 1)


def as_int64(v: int) -> int:
    """A uint64 seed or key as the int64 with the same bits (what ``torch.ops.espert`` schemas take)."""
    v = _check_u64("seed/key", v)
    return v - U64 if v >= 1 << 63 else v


def _unflatten(ws, keys, blocks) -> list:
    if len(keys) != len(ws) or len(blocks) != 4 * len(ws):
        raise ValueError(f"got {len(ws)} tensors, {len(keys)} keys and {len(blocks)} block ints (4 per tensor)")
    out = []
    for i, w in enumerate(ws):
        b = blocks[4 * i : 4 * i + 4]
        block = (
            None
            if all(x == -1 for x in b)
            else Block(b[0], b[1], None if b[2] == -1 else b[2], None if b[3] == -1 else b[3])
        )
        out.append((w, _from_i64(keys[i]), block))
    return out


@torch.library.custom_op("espert::es_update_", mutates_args=("ws",))
def _es_update_op(
    ws: list[torch.Tensor],
    keys: list[int],
    blocks: list[int],
    seeds: torch.Tensor,
    coeffs: torch.Tensor,
    scales: list[float] | None = None,
    noise: str = "gaussian",
) -> None:
    """``torch.ops.espert.es_update_``: :func:`es_update_many_` as a torch operator.
    seeds: int64 [N] (uint64 bits) and coeffs: float32 [N], host tensors, uploaded once per call."""
    if seeds.device.type != "cpu" or coeffs.device.type != "cpu":
        raise ValueError("seeds and coeffs must be host tensors (the op uploads them once per call)")
    es_update_many_(
        _unflatten(ws, keys, blocks),
        [_from_i64(s) for s in seeds.tolist()],
        coeffs.tolist(),
        noise=noise,
        scales=scales,
    )


@_es_update_op.register_fake
def _(ws, keys, blocks, seeds, coeffs, scales=None, noise="gaussian") -> None:
    return None


@torch.library.custom_op("espert::perturb_", mutates_args=("ws",))
def _perturb_op(
    ws: list[torch.Tensor],
    keys: list[int],
    blocks: list[int],
    seed: int,
    sigma: float,
    sign: int = 1,
    scales: list[float] | None = None,
    noise: str = "gaussian",
) -> None:
    """``torch.ops.espert.perturb_``: :func:`perturb_many_` as a torch operator (one member: scalars)."""
    perturb_many_(_unflatten(ws, keys, blocks), _from_i64(seed), sigma, sign, noise=noise, scales=scales)


@_perturb_op.register_fake
def _(ws, keys, blocks, seed, sigma, sign=1, scales=None, noise="gaussian") -> None:
    return None


@torch.library.custom_op("espert::restore_", mutates_args=("w",))
def _restore_op(w: torch.Tensor, center: torch.Tensor) -> None:
    """``torch.ops.espert.restore_``: :func:`restore_` as a torch operator."""
    restore_(w, center)


@_restore_op.register_fake
def _(w, center) -> None:
    return None


def op_args(items) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """``(ws, keys, blocks)`` for the ``torch.ops.espert`` operators from ``(tensor, key, block)`` items."""
    ws, keys, blocks = [], [], []
    for w, key, block in items:
        ws.append(w)
        keys.append(as_int64(key))
        b = block or Block()
        blocks += [
            b.row_offset,
            b.col_offset,
            -1 if b.logical_rows is None else b.logical_rows,
            -1 if b.logical_cols is None else b.logical_cols,
        ]
    return ws, keys, blocks
