"""Launch plans: the int64 table the kernels of every backend read, one row per (block of a) tensor.

A row's columns are ``_C.PLAN_FIELDS`` (csrc/apply.h); :data:`PLAN_DTYPE` types them (the offsets,
logical width and key are uint64, the rest int64) and :func:`plan_table` is the one way a row is
written: the multi-tensor ops, the lowrank staging fill and the Triton test helper
(``espert.kernels.apply.apply``) all build theirs here.  :func:`plan_fields` reads a table back by
field name.  :func:`build_steps` makes the plan of one call: Philox-family entries in one step,
lowrank entries in chunks whose A/B staging fits :data:`STAGING_BYTES`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from espert import _C
from espert.noise import LOWRANK_KEY_A, LOWRANK_KEY_B, NoiseFamily, lowrank_scale

from .checks import DTYPE_CODES, Geometry

FAMILY_CODES = dict(_C.FAMILY_CODES)
PLAN_FIELDS = tuple(_C.PLAN_FIELDS)
_UNSIGNED = ("row_offset", "col_offset", "logical_cols", "key")  # uint64_t in csrc/apply.h
#: One plan row, typed: view an int64 [E, len(PLAN_FIELDS)] table as this (shape [E, 1]) and back.
PLAN_DTYPE = np.dtype([(name, np.uint64 if name in _UNSIGNED else np.int64) for name in PLAN_FIELDS])
ONE_BITS = int(np.float32(1.0).view(np.int32))
# Bounded temporaries (restore_ conversion, lowrank A/B staging): at most this many bytes at once.
# ``espert.ops.STAGING_BYTES = n`` sets this value (the package forwards it here).
STAGING_BYTES = 64 << 20


def plan_table(shape: int | tuple = 1, **fields) -> np.ndarray:
    """Plan rows as an int64 table ``[*shape, len(PLAN_FIELDS)]``: each field named (a scalar or an
    array broadcasting to ``shape``) is stored with its type (uint64 fields keep values >= 2^63 as
    their bits), every other field is 0."""
    unknown = sorted(set(fields) - set(PLAN_FIELDS))
    if unknown:
        raise KeyError(f"not plan fields: {unknown}; the fields are {PLAN_FIELDS}")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    rec = np.zeros(shape, PLAN_DTYPE)
    for name, v in fields.items():
        rec[name] = np.asarray(v, dtype=PLAN_DTYPE[name]) if isinstance(v, (list, tuple)) else v
    return rec.view(np.int64).reshape(shape + (len(PLAN_FIELDS),))


def plan_fields(table: np.ndarray) -> np.ndarray:
    """The rows of an int64 ``[E, len(PLAN_FIELDS)]`` table (C-contiguous) as a structured array ``[E]``
    of :data:`PLAN_DTYPE`, sharing its memory: ``plan_fields(t)["key"]`` reads and writes the keys."""
    return table.view(PLAN_DTYPE)[..., 0]


def units_per_row(cols, family, unit_groups: int):
    """GPU launch units per row of an entry of ``cols`` columns: the row's Philox groups (lowrank: 4
    columns each; rademacher: whole 128-element Philox calls; gaussian: 4 elements, one extra for an
    unaligned start) in units of ``unit_groups``, at least 1.  Arrays broadcast.  Python's one copy of
    the formula (the kernels read the column); csrc/apply.h holds the C++ one (``_C.units_per_row``), and
    tests/test_kernel_codes.py holds the two equal."""
    cols, family = np.asarray(cols, np.int64), np.asarray(family)
    groups_per_row = np.where(
        family == FAMILY_CODES["lowrank"],
        (cols + 3) // 4,
        np.where(family == FAMILY_CODES["rademacher"], 32 * ((cols + 254) // 128), (cols + 6) // 4),
    )
    return np.maximum(1, (groups_per_row + unit_groups - 1) // unit_groups)


@dataclass
class Step:
    """One kernel pass of a call: ``table`` (int64 [E, len(PLAN_FIELDS)]) run with the call's
    coefficients, or with ones (``ones``: the lowrank staging fill); ``groups``: [e0, e1) ranges that
    share a dtype and a family (one GPU launch each); ``zero``: a staging buffer cleared first."""

    table: np.ndarray
    ones: bool
    groups: list
    zero: torch.Tensor | None = None


def _collapse_rows(t: np.ndarray) -> None:
    """In place: a Philox-family entry whose rows are contiguous in memory and in the logical matrix
    (full-width rows, row stride = cols) becomes one long row: fewer row ends, same logical indices."""
    f = plan_fields(t)
    m = (
        (f["family"] != FAMILY_CODES["lowrank"])
        & (f["rows"] > 1)
        & (f["row_stride"] == f["cols"])
        & (f["col_offset"] == 0)
        & (f["logical_cols"] == f["cols"].astype(np.uint64))
    )
    if not m.any():
        return
    start = f["row_offset"][m] * f["logical_cols"][m]  # < 2^64: checked by checks.geometry
    n = f["rows"][m] * f["cols"][m]
    f["rows"][m] = 1
    f["cols"][m] = n
    f["row_stride"][m] = n
    f["row_offset"][m] = 0
    f["col_offset"][m] = start
    f["logical_cols"][m] = start + n.astype(np.uint64)


def finish(t: np.ndarray, unit_groups: int | None) -> tuple[np.ndarray, list]:
    """Collapse rows, sort by (family, dtype) and, for GPU backends, fill units_per_row / unit_start
    per launch group.  Returns (table, [(e0, e1)] groups)."""
    if len(t) == 0:
        return t, []
    _collapse_rows(t)
    f = plan_fields(t)
    t = np.ascontiguousarray(t[np.lexsort((f["dtype"], f["family"]))])
    f = plan_fields(t)
    key = f["family"] * 16 + f["dtype"]
    cuts = [0] + (np.flatnonzero(np.diff(key)) + 1).tolist() + [len(t)]
    groups = list(zip(cuts[:-1], cuts[1:]))
    if unit_groups:
        upr = units_per_row(f["cols"], f["family"], unit_groups)
        f["units_per_row"] = upr
        units = np.where(f["member_end"] > f["member_begin"], f["rows"] * upr, 0)
        for e0, e1 in groups:
            f["unit_start"][e0:e1] = np.concatenate([[0], np.cumsum(units[e0:e1])[:-1]])
    return t, groups


def lowrank_pieces(g: Geometry, w: torch.Tensor, n: int, r: int) -> list[tuple]:
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


def _columns(entries: list[dict]) -> dict:
    """Per-entry field dicts as one list per field (the form :func:`plan_table` takes)."""
    return {name: [e[name] for e in entries] for name in entries[0]}


def build_steps(
    checked: list, fam: NoiseFamily, n: int, scale_bits: list, device, unit_groups: int | None
) -> list[Step]:
    """The launch plan of one call: the Philox-family entries in one step; lowrank entries in chunks
    whose staging fits STAGING_BYTES, each a fill step (A and Bᵀ from the v1 Gaussian) + an apply step.
    checked: [(w, key, geometry, dtype code)]; scale_bits: the float32 bits of each entry's scale."""
    plain, pieces = [], []
    for (w, key, g, code), sb in zip(checked, scale_bits):
        if g.rows == 0 or g.cols == 0:
            continue
        entry = dict(dtype=code, row_stride=g.row_stride, logical_cols=g.logical_cols, key=key, scale_bits=sb)
        if fam.name == "lowrank" and g.logical_rows > 1:
            for data, rows, cols, ro, co in lowrank_pieces(g, w, n, fam.rank):
                pieces.append(dict(entry, data=data, rows=rows, cols=cols, row_offset=ro, col_offset=co))
            continue
        plain.append(
            dict(entry, data=w.data_ptr(), rows=g.rows, cols=g.cols, row_offset=g.row_offset, col_offset=g.col_offset)
        )
    steps = []
    if plain:
        family = FAMILY_CODES["gaussian" if fam.name == "lowrank" else fam.name]  # lowrank's 1-row fallback
        t = plan_table(len(plain), **_columns(plain), family=family, member_end=n)
        t, groups = finish(t, unit_groups)
        steps.append(Step(t, False, groups))
    if not pieces:
        return steps
    r = fam.rank
    budget = STAGING_BYTES // 4
    sizes = [n * r * (p["rows"] + p["cols"]) for p in pieces]
    chunks, cur, used = [], [], 0
    for p, sz in zip(pieces, sizes):
        if cur and used + sz > budget:
            chunks.append(cur)
            cur, used = [], 0
        cur.append(p)
        used += sz
    chunks.append(cur)
    stage = torch.empty(
        max(sum(n * r * (p["rows"] + p["cols"]) for p in c) for c in chunks), dtype=torch.float32, device=device
    )
    for chunk in chunks:
        t = plan_table(len(chunk), **_columns(chunk), family=FAMILY_CODES["lowrank"], rank=r, member_end=n)
        steps.append(lowrank_fill_step(t, n, r, stage, unit_groups))
        at, ag = finish(t, unit_groups)
        steps.append(Step(at, False, ag))
    return steps  # the fill steps hold the staging buffer (zero=stage) until the call returns


def lowrank_fill_step(t: np.ndarray, n: int, r: int, stage: torch.Tensor, unit_groups: int | None) -> Step:
    """The fill step of lowrank plan entries ``t`` (int64 [E, len(PLAN_FIELDS)]: rows, cols, offsets,
    logical_cols, key): lays out each entry's A' [n, rows, r] then Bᵀ [n, r, cols] (float32) in ``stage``
    from its start, writes their addresses into t's stage_a / stage_b, and returns the Gaussian step
    that fills them (run with coefficients 1): A' = K_r·ε_v1(key ^ LOWRANKA) of the logical [R, r]
    matrix's rows, Bᵀ = ε_v1(key ^ LOWRANKB) of the logical [r, C] matrix's columns."""
    k_bits = int(lowrank_scale(r).view(np.int32))
    e = plan_fields(t)
    members = np.arange(n, dtype=np.int64)
    rows, cols = e["rows"], e["cols"]
    size = n * r * (rows + cols)
    sa = stage.data_ptr() + 4 * (np.cumsum(size) - size)  # [N, rows, r] A' then [N, r, cols] Bᵀ per piece
    sb = sa + 4 * n * rows * r
    e["stage_a"], e["stage_b"] = sa, sb
    common = dict(dtype=DTYPE_CODES[torch.float32], family=FAMILY_CODES["gaussian"])
    common.update(member_begin=members, member_end=members + 1)
    # fill entries, piece-major then member: A' (K_r·ε_v1 of [R, r]) and Bᵀ (ε_v1 of [r, C])
    fill_a = plan_table(
        (len(t), n),
        **common,
        data=sa[:, None] + 4 * rows[:, None] * r * members,
        rows=rows[:, None],
        cols=r,
        row_stride=r,
        row_offset=e["row_offset"][:, None],
        logical_cols=r,
        key=e["key"][:, None] ^ np.uint64(LOWRANK_KEY_A),
        scale_bits=k_bits,
    )
    fill_b = plan_table(
        (len(t), n),
        **common,
        data=sb[:, None] + 4 * r * cols[:, None] * members,
        rows=r,
        cols=cols[:, None],
        row_stride=cols[:, None],
        col_offset=e["col_offset"][:, None],
        logical_cols=e["logical_cols"][:, None],
        key=e["key"][:, None] ^ np.uint64(LOWRANK_KEY_B),
        scale_bits=ONE_BITS,
    )
    fills = [f.reshape(-1, len(PLAN_FIELDS)) for f in (fill_a, fill_b)]
    ft, fg = finish(np.concatenate(fills), unit_groups)
    return Step(ft, True, fg, zero=stage)
