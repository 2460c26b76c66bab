"""One ES update, as every Center, Evaluator and engine takes it: :class:`Update`.

    center <- decay·center;  center += Σ_n coeffs[n]·ε(seeds[n]) through the center's optimizer (lr: the
    iteration's α, adam's step size);  then the anchor step toward the base weights (:class:`AnchorStep`)

An Update is validated once, when it is made, and then carried as it is: through the pool and Ray (pickled:
the seeds and coefficients are two arrays, 16 bytes per member), over vLLM's ``collective_rpc`` as plain
values (:meth:`Update.wire`, what ``es_update`` takes) and in the run log (:meth:`Update.of_record`).  A
third-party Center implements ``update(step: Update)`` and reads its fields; it never re-checks them.

Torch-free (numpy only): the ops' own argument checks (:func:`check_members`, :func:`check_u64`) live here so
that the record and the kernels refuse the same things with the same words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from espert.config import U64

#: The norms of anchored weight decay (:mod:`espert.ops.anchor`).
ANCHOR_NORMS = ("l2", "l1")


def check_u64(name: str, v) -> int:
    """``v`` as an int in [0, 2^64): TypeError for a non-integer (bools too), ValueError out of range."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an integer in [0, 2^64), got {v!r}")
    v = int(v)
    if not 0 <= v < U64:
        raise ValueError(f"{name} must be in [0, 2^64), got {v}")
    return v


def check_members(seeds: Sequence[int], coeffs: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Validate population seeds and coefficients; returns (uint64 [N], float32 [N]) arrays.

    Raises ValueError on a length mismatch, a seed outside [0, 2^64), or a NaN/Inf coefficient (or one
    that overflows float32, the kernels' precision).
    """
    seeds, coeffs = list(seeds), list(coeffs)
    if len(seeds) != len(coeffs):
        raise ValueError(f"got {len(seeds)} seeds but {len(coeffs)} coefficients")
    seed_arr = np.array([check_u64(f"seeds[{i}]", s) for i, s in enumerate(seeds)], dtype=np.uint64)
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


def check_factor(name: str, v) -> float:
    """A finite float > 0 (decay factors, scale factors); bools and non-numbers are refused."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class AnchorStep:
    """The anchor step of an update (anchored weight decay, :mod:`espert.ops.anchor`): the norm, ``l2`` or
    ``l1``, and the amount α·λ: in (0, 1) for l2 (the factor 1 - amount stays positive), > 0 for l1."""

    norm: str
    amount: float

    def __post_init__(self):
        if self.norm not in ANCHOR_NORMS:
            raise ValueError(f"anchor norm must be one of {ANCHOR_NORMS}, got {self.norm!r}")
        a = self.amount
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
            raise ValueError(f"anchor amount must be a finite number, got {a!r}")
        if not (0 < a < 1 if self.norm == "l2" else a > 0):
            raise ValueError(
                f"anchor amount (alpha*lambda) must be {'in (0, 1)' if self.norm == 'l2' else '> 0'}, got {a}"
            )
        object.__setattr__(self, "amount", float(a))

    @classmethod
    def of(cls, step: "AnchorStep | dict | None") -> "AnchorStep | None":
        """An AnchorStep from itself, or from the log's ``{"norm", "amount"}`` (None stays None)."""
        if step is None or isinstance(step, AnchorStep):
            return step
        if not isinstance(step, dict) or set(step) != {"norm", "amount"}:
            raise ValueError(f"an anchor step is a dict {{'norm', 'amount'}}, got {step!r:.120}")
        return cls(step["norm"], step["amount"])

    def as_dict(self) -> dict:
        """The log's and the wire's form, ``{"norm", "amount"}``."""
        return {"norm": self.norm, "amount": self.amount}


@dataclass(frozen=True, eq=False)
class Update:
    """One update (module docstring).  seeds: N ints in [0, 2^64) (any iterable; kept as uint64 [N]);
    coeffs: N finite floats (kept as float64 [N]; the kernels round them to float32); decay and lr: finite
    numbers > 0 (lr None: not given, which adam refuses); anchor: an :class:`AnchorStep`, or the log's dict
    of one, or None.  Raises ValueError / TypeError naming the first bad field; nothing else checks them."""

    seeds: np.ndarray
    coeffs: np.ndarray
    decay: float = 1.0
    lr: float | None = None
    anchor: AnchorStep | None = None

    def __post_init__(self):
        seeds, coeffs = list(self.seeds), list(self.coeffs)
        seed_arr, _ = check_members(seeds, coeffs)
        coeff_arr = np.array(coeffs, dtype=np.float64)
        for a in (seed_arr, coeff_arr):
            a.setflags(write=False)
        object.__setattr__(self, "seeds", seed_arr)
        object.__setattr__(self, "coeffs", coeff_arr)
        object.__setattr__(self, "decay", check_factor("decay", self.decay))
        object.__setattr__(self, "lr", None if self.lr is None else check_factor("lr", self.lr))
        object.__setattr__(self, "anchor", AnchorStep.of(self.anchor))

    def wire(self) -> tuple:
        """``(seeds, coeffs, decay, lr, anchor)`` as plain Python values: ``es_update``'s arguments over vLLM's
        ``collective_rpc``, whose serializer takes no arrays or dataclasses."""
        anchor = None if self.anchor is None else self.anchor.as_dict()
        return self.seeds.tolist(), self.coeffs.tolist(), self.decay, self.lr, anchor

    @classmethod
    def of_record(cls, record: dict) -> "Update | None":
        """The update an iteration's log record describes (``seeds``, ``coeffs``, ``decay``, ``alpha`` and,
        since AWD, ``anchor``); None when it moves nothing: no members, no decay and no anchor step, as at
        α = 0 (the end of a schedule, whose anchor amount α·λ is 0 too) or an iteration with no valid reward."""
        anchor = record.get("anchor")
        if not record["seeds"] and record["decay"] == 1.0 and not (anchor and anchor.get("amount")):
            return None
        return cls(record["seeds"], record["coeffs"], record["decay"], record["alpha"], anchor)

    def __repr__(self) -> str:
        return f"Update({len(self.seeds)} members, decay={self.decay}, lr={self.lr}, anchor={self.anchor})"
