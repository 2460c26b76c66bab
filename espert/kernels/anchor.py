"""The Triton kernel of anchored weight decay: csrc/anchor.h's rule, elementwise, for a float32 master and
its anchor (float32, float16 or bfloat16) on the device.  Launched with ``enable_fp_fusion=False`` so
a + p·d never becomes an FMA; bfloat16 is widened with integer operations (the interpreter's casts are
not the hardware's), float16 with ``.to()`` (exact; only NaNs could differ, and the rule leaves an
element whose anchor is NaN as it is)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from espert import _C

FLOAT32_CODE: tl.constexpr = tl.constexpr(_C.DTYPE_CODES["float32"])
BFLOAT16_CODE: tl.constexpr = tl.constexpr(_C.DTYPE_CODES["bfloat16"])
L2_CODE: tl.constexpr = tl.constexpr(_C.ANCHOR_NORM_CODES["l2"])
BLOCK = 1024


@triton.jit
def _anchor_kernel(m_ptr, a_ptr, n, p, DTYPE: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    m = tl.load(m_ptr + i, mask=ok, other=0.0)
    if DTYPE == BFLOAT16_CODE:
        h = tl.load(a_ptr + i, mask=ok, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        a = (h << 16).to(tl.float32, bitcast=True)
    elif DTYPE == FLOAT32_CODE:
        a = tl.load(a_ptr + i, mask=ok, other=0.0)
    else:
        a = tl.load(a_ptr + i, mask=ok, other=0.0).to(tl.float32)
    mb = m.to(tl.uint32, bitcast=True)
    ab = a.to(tl.uint32, bitcast=True)
    finite = ((mb & 0x7F800000) != 0x7F800000) & ((ab & 0x7F800000) != 0x7F800000)
    d = m - a
    if NORM == L2_CODE:
        r = a + p * d
    else:
        db = d.to(tl.uint32, bitcast=True)
        s = (db & 0x7FFFFFFF).to(tl.float32, bitcast=True) - p
        moved = a + (s.to(tl.uint32, bitcast=True) | (db & 0x80000000)).to(tl.float32, bitcast=True)
        r = tl.where(s > 0.0, moved, a)
    tl.store(m_ptr + i, tl.where(finite, r, m), mask=ok)


def anchor_decay(master: torch.Tensor, anchor: torch.Tensor, norm: int, p: float) -> None:
    """master (float32, contiguous) <- the rule with norm code ``norm`` and float32 parameter ``p``; anchor:
    float32 / float16 / bfloat16 of master's shape and device (espert.ops.anchor checks them)."""
    n = master.numel()
    if n == 0:
        return
    dtype = _C.DTYPE_CODES[str(anchor.dtype).removeprefix("torch.")]
    src = anchor.view(torch.int16) if anchor.dtype == torch.bfloat16 else anchor
    _anchor_kernel[(triton.cdiv(n, BLOCK),)](
        master, src, n, p, DTYPE=dtype, NORM=norm, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False
    )
