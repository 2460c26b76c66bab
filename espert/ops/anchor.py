"""Anchored weight decay (AWD, arXiv 2605.30148) as an op: ``anchor_decay_(master, anchor, norm, amount)``.

After an ES update the float32 master moves back toward its anchor (the base weights), elementwise, in
place, one pass (csrc/anchor.h has the rule every backend computes, bit for bit)::

    l2:  m <- a + fl32(1 - amount)·(m - a)          amount = α·λ   (λ = 10 in the paper)
    l1:  m <- a + sign(m - a)·max(|m - a| - amount, 0)               (λ = 0.01)

with every operation a correctly rounded float32 one in that order, and an element whose master or
anchor is not finite left as it is.  The anchor is float32, bfloat16 or float16 (the base in the weights'
own dtype, widened exactly).  A step is described by ``{"norm": "l2" | "l1", "amount": α·λ}``, the
``anchor`` entry of an iteration's log record (:func:`check_anchor_step`).
"""

from __future__ import annotations

import numpy as np
import torch

from espert import _C
from espert.update import ANCHOR_NORMS, AnchorStep  # noqa: F401 - ANCHOR_NORMS: this module's public name

from .backends import select
from .checks import DTYPE_CODES

#: The norms of anchored weight decay (espert.update), and their codes in the kernels (csrc/anchor.h).
ANCHOR_NORM_CODES = dict(_C.ANCHOR_NORM_CODES)


def check_anchor_step(step) -> tuple[str, float]:
    """``(norm, amount)`` of an anchor step (an :class:`~espert.update.AnchorStep`, or the log's ``{"norm",
    "amount"}``), checked as AnchorStep checks it."""
    s = AnchorStep.of(step)
    if s is None:
        raise ValueError("an anchor step is a dict {'norm', 'amount'}, got None")
    return s.norm, s.amount


def anchor_param(norm: str, amount: float) -> np.float32:
    """The kernels' float32 parameter p: l2: fl32(1 - amount) (the difference taken in float64); l1: fl32(amount)."""
    return np.float32(1.0 - amount) if norm == "l2" else np.float32(amount)


def _check_tensors(master, anchor) -> None:
    for name, t in (("master", master), ("anchor", anchor)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous() or t.device.type == "meta":
            raise ValueError(f"{name} must be a contiguous tensor with data, got strides {t.stride()} on {t.device}")
    if master.dtype != torch.float32:
        raise TypeError(f"master must be float32, got {master.dtype}")
    if anchor.dtype not in DTYPE_CODES:
        raise TypeError(f"anchor must be float32, float16 or bfloat16, got {anchor.dtype}")
    if anchor.shape != master.shape or anchor.device != master.device:
        raise ValueError(
            f"anchor {anchor.dtype}{tuple(anchor.shape)} on {anchor.device} does not match master "
            f"{tuple(master.shape)} on {master.device}"
        )


@torch.no_grad()
def anchor_decay_(master: torch.Tensor, anchor: torch.Tensor, step, *, backend: str | None = None):
    """In place: ``master <- rule(master, anchor)`` for the anchor step (an AnchorStep or ``{"norm", "amount"}``).

    master: float32, contiguous, cpu or cuda; anchor: the same shape and device, float32 / float16 /
    bfloat16, contiguous.  Everything is validated before the kernel runs.  Returns ``master``."""
    norm, amount = check_anchor_step(step)
    _check_tensors(master, anchor)
    if master.numel() == 0:
        return master
    be = select(master, backend, kind="anchor")
    be.anchor(master, anchor, DTYPE_CODES[anchor.dtype], ANCHOR_NORM_CODES[norm], float(anchor_param(norm, amount)))
    return master
