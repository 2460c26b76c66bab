"""The emulated CUDA backend: the CUDA kernels' bodies run on the CPU (tests/cuda_host/emulate.cpp), as an
ops backend named ``cuda_emulated`` for CPU tensors.  Float calls go through the ops' own CUDA launch
plans (the CUDA unit size, one launch per dtype and family, the lowrank staging fill), quantized calls
through the quantized kernels' argument row; every launch copies the memory its plan may touch (plus
``pad`` bytes on each side) into the emulator, which launches the kernel with the real grid (or
``max_blocks``) and writes it back.  ``register()`` installs it; tests compare it with the CPU backend.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from espert import _C
from espert.ops import backends as B

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("g++") or shutil.which("c++")
FLAGS = ["-std=c++17", "-ffp-contract=off", "-DESPERT_WITH_CUDA", "-Wall", "-Werror", "-Wno-unknown-pragmas"]
BUILDS = {
    "plain": ["-O2"],
    "sanitized": ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"],
}
SOURCES = ["tests/cuda_host/emulate.cpp", "csrc/cuda/host_shim.h", "csrc/cuda/apply_kernel.cuh",
           "csrc/cuda/quant_kernel.cuh", "csrc/cuda/anchor_kernel.cuh", "csrc/apply.h", "csrc/noise.h", "csrc/quant.h",
           "csrc/anchor.h"]  # fmt: skip
_FAILED: dict[Path, str] = {}
_ES = {0: 4, 1: 2, 2: 2}  # plan dtype code -> bytes per element
_F = {name: i for i, name in enumerate(_C.PLAN_FIELDS)}
_Q = {name: i for i, name in enumerate(_C.QUANT_FIELDS)}


def build(kind: str = "plain") -> Path:
    """The emulator binary for the sources as they are now (built once per content, in the temp dir)."""
    if CXX is None:
        raise RuntimeError("no host C++ compiler (g++) for the emulated CUDA backend")
    h = hashlib.sha256(" ".join(FLAGS + BUILDS[kind]).encode())
    for src in SOURCES:
        h.update((ROOT / src).read_bytes())
    out = Path(tempfile.gettempdir()) / f"espert-emulate-{kind}-{h.hexdigest()[:16]}"
    if out in _FAILED:  # a build that failed once fails at once (not once per test)
        raise RuntimeError(_FAILED[out])
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [CXX, *FLAGS, *BUILDS[kind], "-o", str(tmp), str(ROOT / SOURCES[0])]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            _FAILED[out] = f"the emulator did not build ({kind}):\n{res.stderr[-3000:]}"
            raise RuntimeError(_FAILED[out])
        tmp.replace(out)  # atomic: parallel test workers may build at once
    return out


@dataclass
class Emulator:
    binary: Path
    max_blocks: int = 0  # 0: the real grid
    pad: int = 0  # bytes sent on each side of every extent, and checked unchanged (never written back)
    last_blocks: int = 0

    def unit_groups(self) -> int:
        return int(subprocess.run([str(self.binary), "--unit-groups"], capture_output=True, text=True).stdout)

    def run(
        self, kind: int, extents: list[tuple[int, int]], pointers, tail, seeds, coeffs, capacity: int = 0
    ) -> tuple[int, np.ndarray]:
        """One launch: `extents` (address, bytes), each widened by `pad` bytes on both sides, are merged
        into regions; every pointer field in `pointers` (numpy int64 views to rewrite) becomes a region
        reference; tail() (read after that) ends the input; the emulator runs.  The extents are written
        back; a byte changed in the padding (memory the plan does not cover) is an error.  Kind 2 (a
        recording launch) returns the miss count and the records with the caller's addresses."""
        extents = [(a, n) for a, n in extents if n > 0]
        regions = []
        for a, n in sorted((a - self.pad, n + 2 * self.pad) for a, n in extents):
            if regions and a <= regions[-1][0] + regions[-1][1]:
                end = max(regions[-1][0] + regions[-1][1], a + n)
                regions[-1] = (regions[-1][0], end - regions[-1][0])
            else:
                regions.append((a, n))
        for view in pointers:
            for k, p in enumerate(view):
                if p:
                    r = next(i for i, (a, n) in enumerate(regions) if a <= int(p) < a + n)
                    view[k] = ((r + 1) << 44) | (int(p) - regions[r][0])
        sent = [ctypes.string_at(a, n) for a, n in regions]
        out = [struct.pack("<qq", kind, len(regions))]
        for (a, n), raw in zip(regions, sent):
            out += [struct.pack("<qq", n, a % 256), raw, b"\0" * (-n % 8)]
        c = np.asarray(coeffs, np.float32).tobytes()
        s = np.asarray(seeds).view(np.uint64).tobytes()
        out += [struct.pack("<q", len(s) // 8), s, c, b"\0" * (-len(c) % 8), struct.pack("<q", self.max_blocks), tail()]
        with tempfile.TemporaryDirectory() as d:
            src, dst = Path(d) / "in", Path(d) / "out"
            src.write_bytes(b"".join(out))
            res = subprocess.run([str(self.binary), str(src), str(dst)], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"emulated CUDA kernel failed ({res.returncode}): {res.stderr[-3000:]}")
            data = dst.read_bytes()
        count, records, at = 0, np.zeros((0, 2), np.int64), 0
        if kind == 2:
            count = int(np.frombuffer(data[:8], np.int64)[0])
            records = np.frombuffer(data[8:], np.int64, count=2 * min(count, capacity))
            records = records.reshape(-1, 2).copy()
            at = 8 + records.nbytes
            r = (records[:, 0] >> 44) - 1
            records[:, 0] = np.array([a for a, _ in regions], np.int64)[r] + (records[:, 0] & ((1 << 44) - 1))
        got = []
        for a, n in regions:
            got.append(data[at : at + n])
            at += n
        covered = [np.zeros(n, bool) for _, n in regions]
        for a, n in extents:  # write back what the plan covers
            r = next(i for i, (b, m) in enumerate(regions) if b <= a < b + m)
            lo = a - regions[r][0]
            covered[r][lo : lo + n] = True
            ctypes.memmove(a, got[r][lo : lo + n], n)
        for (a, _), raw, new, cov in zip(regions, sent, got, covered):
            diff = np.frombuffer(raw, np.uint8) != np.frombuffer(new, np.uint8)
            if (diff & ~cov).any():
                raise RuntimeError(
                    f"emulated CUDA kernel wrote outside its plan's memory, at {a + int(np.argmax(diff & ~cov)):#x}"
                )
        self.last_blocks = int(res.stdout.split()[1])
        return count, records

    # ---- the ops backend -----------------------------------------------------------------------
    def launch(self, device, steps, staged, patch=None) -> None:
        seeds = staged.seeds.numpy()
        for st in steps:
            if st.zero is not None:
                st.zero.zero_()
            coeffs = (staged.ones if st.ones else staged.coeffs).numpy()
            _C.check_plan(st.table.ctypes.data, len(st.table), len(seeds))  # as apply_many_cuda's binding does
            for e0, e1 in st.groups:
                B.COUNTERS["launches"] += 1
                rows = np.ascontiguousarray(st.table[e0:e1])
                extents = []
                for r in rows:
                    es, nr, nc, stride = (
                        _ES[int(r[_F["dtype"]])],
                        int(r[_F["rows"]]),
                        int(r[_F["cols"]]),
                        int(r[_F["row_stride"]]),
                    )
                    extents.append((int(r[_F["data"]]), ((nr - 1) * stride + nc) * es))
                    if r[_F["stage_a"]]:
                        m = int(r[_F["member_end"]] - r[_F["member_begin"]])
                        extents += [(int(r[_F["stage_a"]]), 4 * m * nr * int(r[_F["rank"]])),
                                    (int(r[_F["stage_b"]]), 4 * m * int(r[_F["rank"]]) * nc)]  # fmt: skip
                ptrs = [rows[:, _F["data"]], rows[:, _F["stage_a"]], rows[:, _F["stage_b"]]]
                rec = patch is not None and not st.ones
                cap = patch.capacity if rec else 0

                def tail(rows=rows, rec=rec, cap=cap):
                    return struct.pack("<q", len(rows)) + rows.tobytes() + (struct.pack("<q", cap) if rec else b"")

                count, records = self.run(2 if rec else 0, extents, ptrs, tail, seeds, coeffs, cap)
                if rec:  # the launch's list appended to the call's, as the device's counter would
                    at = int(patch.count[0])
                    keep = records[: max(0, patch.capacity - at)]
                    patch.records[at : at + len(keep)] = torch.from_numpy(keep)
                    patch.count += count

    def quant(self, qw, g, master, mode, seeds, coeffs, key, qn) -> None:
        from espert.quant.ops import _kernel_args

        row = np.ascontiguousarray(_kernel_args(qw, g, master, mode, qn, 0, 0, len(seeds), key)).reshape(-1)
        tensors = [g.data, qw.scales] + [t for t in (master, qn.stage) if t is not None]
        extents = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]
        names = ("codes", "scales", "master", "stage_a", "stage_b")
        ptrs = [row[_Q[n] : _Q[n] + 1] for n in names]
        self.run(1, extents, ptrs, row.tobytes, np.asarray(seeds, np.uint64), coeffs)

    def anchor(self, master, anchor, dtype: int, norm: int, p: float) -> None:
        """Anchored weight decay through the CUDA kernel's body (kind 3): master and anchor are the regions."""
        extents = [(master.data_ptr(), master.numel() * 4), (anchor.data_ptr(), anchor.numel() * anchor.element_size())]
        ptrs = [np.array([master.data_ptr(), anchor.data_ptr()], np.int64)]
        tail = lambda: ptrs[0].tobytes() + struct.pack("<qqqf4x", master.numel(), dtype, norm, p)  # noqa: E731
        self.run(3, extents, ptrs, tail, np.zeros(0, np.uint64), [])


def register(monkeypatch=None, kind: str = "plain", max_blocks: int = 0, pad: int = 0) -> Emulator:
    """Install ``cuda_emulated`` in ops.BACKENDS (for the test, when given its monkeypatch; else for the
    process); returns the engine, whose max_blocks and pad may be changed between calls."""
    em = Emulator(build(kind), max_blocks, pad)
    groups = em.unit_groups()
    be = B.Backend(
        "cuda_emulated",
        lambda w: w.device.type == "cpu",
        lambda device, steps, seeds, coeffs: B.upload(device, steps, seeds, coeffs, copy=False),
        em.launch,
        lambda: groups,
        em.quant,
        B._patch_cpu,  # the records hold this process's addresses: the CPU writes them back
        em.anchor,
    )
    if monkeypatch is None:
        B.BACKENDS["cuda_emulated"] = be
    else:
        monkeypatch.setitem(B.BACKENDS, "cuda_emulated", be)
    return em
