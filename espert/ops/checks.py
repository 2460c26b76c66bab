"""The ops' argument rules, each defined once and shared by the float ops (:mod:`espert.ops`) and the
quantized ones (:mod:`espert.quant.ops`): seeds and keys, σ, sign, scales, members, the weight's
dtype and geometry (:class:`Block`), and the flattened arguments of the ``torch.ops.espert`` operators.

:func:`check_u64`, :func:`check_sigma`, :func:`check_sign` and :func:`as_int64` are plain Python
(no numpy), so they also run while torch.compile traces a call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from espert import _C
from espert.config import U64
from espert.update import check_members, check_u64  # noqa: F401 - the ops check what an Update checks

# Codes come from the compiled module, the one place they are defined (csrc/noise.h, csrc/apply.h).
DTYPE_CODES = {getattr(torch, name): code for name, code in _C.DTYPE_CODES.items()}
# The doubles that round (to nearest even) to a normal, finite float32: [2^-126 - 2^-150, 2^128 - 2^103).
# A tie at the low end goes to 2^-126 (even mantissa), at the high end to infinity.  Every σ reaches
# float32 through a double (numpy converts ints and long doubles that way too).
_NORMAL32_LO = 2.0**-126 - 2.0**-150
_NORMAL32_HI = 2.0**128 - 2.0**103


def _real(v) -> bool:
    """An int or float (numpy's included), not a bool."""
    return not isinstance(v, (bool, np.bool_)) and isinstance(v, (int, float, np.floating, np.integer))


def _normal32(v) -> bool:
    """``float32(v)`` (v finite, > 0) is a normal finite float32."""
    return _NORMAL32_LO <= float(v) < _NORMAL32_HI


def check_sigma(sigma) -> float:
    """σ as a float: a finite number > 0 that is normal in float32 (the kernels' precision)."""
    if not _real(sigma) or not math.isfinite(sigma) or sigma <= 0:
        raise ValueError(f"sigma must be a finite number > 0, got {sigma!r}")
    if not _normal32(sigma):
        raise ValueError(f"sigma {sigma!r} is 0, subnormal or infinite in float32 (the kernels' precision)")
    return float(sigma)


def check_sign(sign) -> int:
    """The int +1 or -1 (not a bool, a float or a numpy integer)."""
    if type(sign) is not int or sign not in (1, -1):
        raise ValueError(f"sign must be the int +1 or -1, got {sign!r} ({type(sign).__name__})")
    return sign


def check_scale(name: str, s) -> float:
    """A per-tensor coefficient scale as a float: a finite number > 0 that is normal in float32."""
    if not _real(s) or not math.isfinite(s) or s <= 0 or not _normal32(s):
        raise ValueError(f"{name} must be a finite number > 0 that is normal in float32, got {s!r}")
    return float(s)


def as_int64(v: int, name: str = "seed/key") -> int:
    """A uint64 seed or key as the int64 with the same bits (what ``torch.ops.espert`` schemas take)."""
    v = check_u64(name, v)
    return v - U64 if v >= 1 << 63 else v


def from_int64(v: int) -> int:
    """The uint64 whose bits the int64 ``v`` holds (inverse of :func:`as_int64`)."""
    return int(v) & (U64 - 1)


def check_weight(w: torch.Tensor) -> int:
    """The dtype code of a float32 / float16 / bfloat16 tensor; TypeError for anything else."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in DTYPE_CODES:
        raise TypeError(f"unsupported dtype {w.dtype}: espert ops take float32, float16 and bfloat16 weights")
    return DTYPE_CODES[w.dtype]


# ---- geometry ------------------------------------------------------------------------------


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
class Geometry:
    rows: int
    cols: int
    row_stride: int
    row_offset: int
    col_offset: int
    logical_cols: int
    logical_rows: int = 0


def geometry(w: torch.Tensor, block: Block | None) -> Geometry:
    """The [rows, cols] view the kernels address (row stride, unit column stride) and its place in
    the logical matrix; ValueError for a layout they cannot address or a block outside the shape."""
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
        return Geometry(rows, cols, row_stride, 0, 0, cols, rows)
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
    return Geometry(rows, cols, row_stride, ro, co, lc, lr)


def _strips_meet(a: int, s1: int, r1: int, c1: int, b: int, s2: int, r2: int, c2: int) -> bool:
    """Whether ``{a + i·s1 + j : i < r1, j < c1}`` and ``{b + k·s2 + l : k < r2, l < c2}`` share an address.

    Rows of one strip are ``[a + i·s1, a + i·s1 + c1)``.  With equal strides, row i of A meets row k of
    B iff ``-c2 < d + m·s < c1`` for ``d = b - a``, ``m = k - i``: one integer interval test.  Otherwise
    each row of the strip with fewer rows is tested against the other strip that way."""
    if a + (r1 - 1) * s1 + c1 <= b or b + (r2 - 1) * s2 + c2 <= a:
        return False  # the address ranges are apart
    if s1 == s2 or r1 == 1 or r2 == 1:
        s = s2 if r1 == 1 else s1  # the stride of a strip with more than one row (any, for two single rows)
        d = b - a
        lo = max(1 - r1, (-c2 - d) // s + 1)
        hi = min(r2 - 1, -((d - c1) // s) - 1)
        return lo <= hi
    if r1 > r2:
        a, s1, r1, c1, b, s2, r2, c2 = b, s2, r2, c2, a, s1, r1, c1
    return any(_strips_meet(a + i * s1, s1, 1, c1, b, s2, r2, c2) for i in range(r1))


def check_disjoint(checked) -> None:
    """ValueError when two tensors of one call share memory (the update would be applied twice there).

    checked: ``[(w, key, geometry, code)]``; views of one storage that touch disjoint elements (e.g. the
    column blocks of a fused matrix) are fine."""
    spans = []
    for k, (w, _, g, _) in enumerate(checked):
        if not w.numel():
            continue
        e = w.element_size()
        spans.append((k, w.data_ptr(), g.row_stride * e, g.rows, g.cols * e))
    spans.sort(key=lambda x: x[1])
    for x in range(len(spans)):
        k, a, s1, r1, c1 = spans[x]
        for y in range(x + 1, len(spans)):
            j, b, s2, r2, c2 = spans[y]
            if b >= a + (r1 - 1) * s1 + c1:
                break  # sorted by start: no later span begins inside this one
            if _strips_meet(a, s1, r1, c1, b, s2, r2, c2):
                i, j = sorted((k, j))
                raise ValueError(
                    f"items[{i}] and items[{j}] overlap in memory (views of one storage that share elements); "
                    f"each element may be updated once per call: pass disjoint views"
                )


# ---- the torch operators' arguments --------------------------------------------------------
# Integers in schemas are int64: uint64 seeds and keys travel as their two's-complement bits.  Blocks
# travel flattened, four ints per tensor (row_offset, col_offset, logical_rows, logical_cols), -1 for None.


def op_args(items) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """``(ws, keys, blocks)`` for the ``torch.ops.espert`` operators from ``(tensor, key, block)`` items."""
    ws, keys, blocks = [], [], []
    for k, (w, key, block) in enumerate(items):
        ws.append(w)
        keys.append(as_int64(key, f"items[{k}] key"))
        b = block or Block()
        blocks += [
            b.row_offset,
            b.col_offset,
            -1 if b.logical_rows is None else b.logical_rows,
            -1 if b.logical_cols is None else b.logical_cols,
        ]
    return ws, keys, blocks


def from_op_args(ws, keys, blocks) -> list:
    """The ``(tensor, key, block)`` items of :func:`op_args`'s flattened form."""
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
        out.append((w, from_int64(keys[i]), block))
    return out


def check_meta_mix(op: str, tensors: Sequence[torch.Tensor]) -> None:
    """ValueError when one ``torch.ops.espert`` call mixes meta tensors with real ones.

    Such a call is dispatched to the operator's fake kernel, which writes nothing: refusing it keeps a
    meta argument from passing as a completed op.  Calls whose tensors are all meta (shape propagation)
    or fake (torch.compile tracing) are what the fake kernels are for."""
    from torch._subclasses.fake_tensor import is_fake

    real = [t for t in tensors if not is_fake(t)]
    meta = sum(t.device.type == "meta" for t in real)
    if 0 < meta < len(real):
        devices = sorted({str(t.device) for t in real})
        raise ValueError(
            f"torch.ops.espert.{op}: {meta} of its {len(real)} tensors are on the meta device (they hold no "
            f"data) and the rest on {', '.join(d for d in devices if d != 'meta')}; every tensor must hold data"
        )
