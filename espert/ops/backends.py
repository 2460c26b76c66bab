"""The one backend registry: ``BACKENDS`` maps a name to its capability gate and its kernels (float
launch plans in ``run``; quantized lattices in ``quant``, attached by :mod:`espert.quant.ops`).
``backend=None`` picks the default for the tensor's device (``ESPERT_BACKEND`` overrides it):

    cpu     C++ kernels in espert._C (AVX-512, AVX2 or generic, chosen at run time)
    cuda    CUDA kernels in espert._C (when the module was built with nvcc)
    triton  Triton kernels in espert/kernels/ (GPU; CPU tensors only under TRITON_INTERPRET=1)

``COUNTERS`` / :func:`counting` count kernel launches and host-to-device copies.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from espert import _C

from .checks import DTYPE_CODES
from .plan import FAMILY_CODES, ONE_BITS, Step, lowrank_fill_step, plan_fields, plan_table

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


@dataclass(frozen=True)
class Backend:
    """A kernel backend: one entry serves every weight type.  Float launch plans go through ``stage``
    (seeds, coefficients and tables to where the kernels read them) and ``launch`` (the kernels, reading
    only staged buffers: no allocation, no host copy, so a CUDA graph can capture it; see
    :class:`espert.ops.prepared.Prepared`).  ``quant`` (filled in by :mod:`espert.quant.ops`) runs the
    quantized lattice kernels.  Either kind may be None where the backend has no such kernels
    (``reference`` is quantized-only)."""

    name: str
    supports: Callable[[torch.Tensor], bool]  # capability gate, on the (storage) tensor
    stage: Callable | None  # (device, steps, seeds uint64 [N], coeffs float32 [N]) -> Staged
    launch: Callable | None = None  # (device, steps, Staged) -> None
    unit_groups: Callable[[], int] | None = None  # GPU: Philox groups per launch unit (None: CPU tiles itself)
    quant: Callable | None = None  # (qw, geometry, master, mode, seeds, coeffs, key, family name) -> None
    write_patch: Callable | None = None  # (device, PatchList, n) -> None: records [0, n) written back
    anchor: Callable | None = None  # (master, anchor, dtype code, norm code, p) -> None: anchored weight decay

    @property
    def run(self) -> Callable | None:
        """(device, steps, seeds, coeffs, patch=None) -> None: stage, then launch (None: no float kernels).
        patch: a :class:`~espert.ops.patch.PatchList` the weight-writing steps record into."""
        if self.stage is None:
            return None
        return lambda device, steps, seeds, coeffs, patch=None: self.launch(
            device, steps, self.stage(device, steps, seeds, coeffs), patch
        )


class Staged(NamedTuple):
    """A call's buffers where its kernels read them: seeds int64 [N] (uint64 bits), coeffs and ones
    float32 [N], one int64 [E, F] table per step, and ``members`` int64 [M], the one piece of memory
    that holds the seeds and the coefficients (rewriting it switches members; see Prepared)."""

    seeds: torch.Tensor
    coeffs: torch.Tensor
    ones: torch.Tensor
    tables: list
    members: torch.Tensor


def sync_cpu_threads() -> None:
    """Give espert's CPU kernels torch's thread count (they run on a separate OpenMP runtime)."""
    _C.set_num_threads(torch.get_num_threads())


def _slots(n_int64: int) -> int:
    """int64 slots for a region of the upload, rounded up to 16 bytes (two slots)."""
    return n_int64 + (n_int64 & 1)


def member_slots(n: int) -> np.ndarray:
    """The host image of a staged ``members`` region for n members (int64, zeros): seeds, then coefficients."""
    return np.zeros(_slots(n) + _slots((n + 1) // 2), np.int64)


def write_members(region: np.ndarray, seeds: np.ndarray, coeffs: np.ndarray) -> None:
    """Seeds (uint64 [n]) and coefficients (float32 [n]) into a :func:`member_slots` image, in place."""
    n = len(seeds)
    region[:n] = seeds.view(np.int64)
    region[_slots(n) :].view(np.float32)[:n] = coeffs


def upload(
    device, steps: list[Step], seeds: np.ndarray, coeffs: np.ndarray, *, copy: bool = True, rows: Sequence = ()
) -> Staged:
    """Seeds, coefficients, ones, every step's table and the int64 ``rows`` (a quantized kernel's QuantEntry)
    in ONE host-to-device copy (``copy=False`` on a CPU device: the host buffer itself, nothing counted);
    ``Staged.tables`` holds the steps' tables, then the rows.

    Every region starts 16-byte aligned, whatever the number of members or plan rows: Triton
    specializes a kernel on its pointers' 16-byte alignment, so an odd count would compile a second
    variant of every kernel."""
    n = len(seeds)
    half = (n + 1) // 2  # two float32 per int64 slot
    tables = [st.table for st in steps] + list(rows)
    sizes = [_slots(n), _slots(half), _slots(half)] + [_slots(t.size) for t in tables]
    host_np = np.zeros(sum(sizes), np.int64)
    starts = np.cumsum([0] + sizes[:-1])
    write_members(host_np[: starts[2]], seeds, coeffs)
    host_np[starts[2] : starts[2] + half].view(np.float32)[:n] = 1.0
    for t, at in zip(tables, starts[3:]):
        host_np[at : at + t.size] = t.reshape(-1)
    host = torch.from_numpy(host_np)
    if copy or device.type != "cpu":
        if device.type == "cuda":
            host = host.pin_memory()
        COUNTERS["h2d"] += 1
        dev = host.to(device, non_blocking=True)
    else:
        dev = host
    s = dev[:n]
    c = dev[starts[1] : starts[1] + half].view(torch.float32)[:n]
    o = dev[starts[2] : starts[2] + half].view(torch.float32)[:n]
    staged = [dev[at : at + t.size].view(t.shape) for t, at in zip(tables, starts[3:])]
    return Staged(s, c, o, staged, dev[: starts[2]])


def _stage_cpu(device, steps: list[Step], seeds: np.ndarray, coeffs: np.ndarray) -> Staged:
    return upload(device, steps, seeds, coeffs, copy=False)


def _patch_args(patch, st: Step) -> tuple[int, int, int]:
    """A step's (records, capacity, count) pointers for the kernels: none for the lowrank staging fill,
    which writes no weight."""
    if patch is None or st.ones:
        return 0, 0, 0
    return patch.records.data_ptr(), patch.capacity, patch.count.data_ptr()


def _launch_cpu(device, steps: list[Step], staged: Staged, patch=None) -> None:
    sync_cpu_threads()
    for st, table in zip(steps, staged.tables):
        if st.zero is not None:
            st.zero.zero_()
        c = staged.ones if st.ones else staged.coeffs
        COUNTERS["launches"] += 1
        _C.apply_many_cpu(
            table.data_ptr(),
            len(st.table),
            staged.seeds.data_ptr(),
            c.data_ptr(),
            len(staged.seeds),
            *_patch_args(patch, st),
        )


def _patch_cpu(device, patch, n: int) -> None:
    _C.apply_patch_cpu(patch.records.data_ptr(), n)


def _patch_cuda(device, patch, n: int) -> None:
    with torch.cuda.device(device):
        _C.apply_patch_cuda(patch.records.data_ptr(), n, torch.cuda.current_stream(device).cuda_stream)


def _patch_triton(device, patch, n: int) -> None:
    from espert.kernels.apply import apply_patch

    ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        apply_patch(patch.records, n)


def _launch_cuda(device, steps: list[Step], staged: Staged, patch=None) -> None:
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        for st, dt in zip(steps, staged.tables):
            if st.zero is not None:
                st.zero.zero_()
            for e0, e1 in st.groups:
                COUNTERS["launches"] += 1
                _C.apply_many_cuda(
                    st.table[e0:].ctypes.data,
                    dt[e0].data_ptr(),
                    e1 - e0,
                    len(staged.seeds),
                    staged.seeds.data_ptr(),
                    (staged.ones if st.ones else staged.coeffs).data_ptr(),
                    stream,
                    *_patch_args(patch, st),
                )


def _stage_gpu(device, steps: list[Step], seeds: np.ndarray, coeffs: np.ndarray) -> Staged:
    ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        return upload(device, steps, seeds, coeffs)


def _stage_triton(device, steps: list[Step], seeds: np.ndarray, coeffs: np.ndarray) -> Staged:
    from espert.kernels.apply import icdf_table

    icdf_table(device)  # made here, outside any CUDA graph capture: launches only read it
    return _stage_gpu(device, steps, seeds, coeffs)


def _launch_triton(device, steps: list[Step], staged: Staged, patch=None) -> None:
    from espert.kernels.apply import apply_many

    for st in steps:  # the codes are checked by C++ here too: one rule for every backend
        _C.check_plan(st.table.ctypes.data, len(st.table), len(staged.seeds))
    ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        for st, dt in zip(steps, staged.tables):
            if st.zero is not None:
                st.zero.zero_()
            for e0, e1 in st.groups:
                COUNTERS["launches"] += 1
                apply_many(
                    plan_fields(st.table[e0:e1]),
                    dt[e0:e1],
                    staged.seeds,
                    staged.ones if st.ones else staged.coeffs,
                    patch=None if st.ones else patch,
                )


def _triton_ok(w: torch.Tensor) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return w.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _triton_block() -> int:
    from espert.kernels.apply import DEFAULT_BLOCK

    return DEFAULT_BLOCK


def _anchor_cpu(master, anchor, dtype: int, norm: int, p: float) -> None:
    """Anchored weight decay (espert/ops/anchor.py) with the C++ kernel: one OpenMP pass on the host."""
    sync_cpu_threads()
    COUNTERS["launches"] += 1
    _C.anchor_decay_cpu(master.data_ptr(), anchor.data_ptr(), dtype, master.numel(), norm, p)


def _anchor_cuda(master, anchor, dtype: int, norm: int, p: float) -> None:
    with torch.cuda.device(master.device):
        COUNTERS["launches"] += 1
        stream = torch.cuda.current_stream(master.device).cuda_stream
        _C.anchor_decay_cuda(master.data_ptr(), anchor.data_ptr(), dtype, master.numel(), norm, p, stream)


def _anchor_triton(master, anchor, dtype: int, norm: int, p: float) -> None:
    from espert.kernels.anchor import anchor_decay

    ctx = torch.cuda.device(master.device) if master.is_cuda else contextlib.nullcontext()
    with ctx:
        COUNTERS["launches"] += 1
        anchor_decay(master, anchor, norm, p)


BACKENDS: dict[str, Backend] = {
    "cpu": Backend(
        "cpu", lambda w: w.device.type == "cpu", _stage_cpu, _launch_cpu, write_patch=_patch_cpu, anchor=_anchor_cpu
    ),
    "cuda": Backend(
        "cuda",
        lambda w: w.is_cuda and bool(_C.has_cuda),
        _stage_gpu,
        _launch_cuda,
        lambda: int(_C.CUDA_UNIT_GROUPS),
        write_patch=_patch_cuda,
        anchor=_anchor_cuda,
    ),
    "triton": Backend(
        "triton",
        _triton_ok,
        _stage_triton,
        _launch_triton,
        _triton_block,
        write_patch=_patch_triton,
        anchor=_anchor_triton,
    ),
}


def register_quant_runner(name: str, quant: Callable, supports: Callable[[torch.Tensor], bool] | None = None) -> None:
    """Attach the quantized kernels of backend ``name`` (a new backend needs ``supports``)."""
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
    (``"run"``: float, ``"quant"``: quantized, ``"anchor"``: anchored weight decay)."""
    return [name for name, b in BACKENDS.items() if getattr(b, kind) is not None and b.supports(w)]


def select(w: torch.Tensor, name: str | None, kind: str = "run") -> Backend:
    """The backend named (or the default, ``ESPERT_BACKEND`` first) for storage tensor ``w``."""
    name = name or default_backend(w)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}")
    b = BACKENDS[name]
    if getattr(b, kind) is None:
        what = {"run": "float", "quant": "quantized", "anchor": "anchored-weight-decay"}[kind]
        raise ValueError(f"backend {name!r} has no {what} kernels; available: {available_backends(w, kind)}")
    if not b.supports(w):
        raise ValueError(
            f"backend {name!r} cannot run on a {w.device} tensor here; available: {available_backends(w, kind)}"
        )
    return b


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
    t = plan_table(
        1,
        dtype=DTYPE_CODES[torch.float32],
        rows=rows,
        cols=cols,
        row_stride=cols,
        row_offset=row_offset,
        col_offset=col_offset,
        logical_cols=logical_cols,
        key=key,
        scale_bits=ONE_BITS,
        family=FAMILY_CODES["lowrank"],
        rank=rank,
        member_end=n,
    )
    stage = torch.empty(n * rank * (rows + cols), dtype=torch.float32, device=device)
    be = BACKENDS[backend]
    step = lowrank_fill_step(t, n, rank, stage, be.unit_groups and be.unit_groups())
    be.run(device, [step], seeds, np.ones(n, np.float32))
    f = plan_fields(t)[0]
    return stage, int(f["stage_a"]), int(f["stage_b"])
