"""The CUDA kernel as a CI backend (issue 21 §2): csrc/cuda/apply_kernel.cuh, the body apply_cuda.cu
launches, compiled as host C++ through csrc/cuda/host_shim.h (tests/cuda_host/emulate.cpp) and run
block by block, thread by thread on launch plans that espert/ops builds for the CUDA backend (its unit
size, its launch groups, the lowrank staging fill).  Its bits must equal the CPU backend's, on every
dtype and family, with guard bands around every tensor, with the real grid and with forced small
grids (so the grid-stride loop runs), and under ASan and UBSan.  This is how a CPU-only CI sees the
CUDA kernel's indexing: vector-path alignment, row ends, unaligned Block starts, 64-bit indices."""

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from espert import ops
from espert.noise import NoiseFamily
from espert.ops.core import _check_items
from espert.ops.plan import build_steps, plan_fields

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler")
FLAGS = ["-std=c++17", "-ffp-contract=off", "-DESPERT_WITH_CUDA", "-Wall", "-Werror", "-Wno-unknown-pragmas"]
SANITIZE = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
GUARD = 24  # elements of guard band before and after every tensor


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """{"plain": path, "sanitized": path} of the emulator built from the kernel header as it is now."""
    d = tmp_path_factory.mktemp("emulate")
    out = {}
    for name, flags in (("plain", ["-O2"]), ("sanitized", SANITIZE)):
        out[name] = d / f"emulate_{name}"
        src = str(ROOT / "tests/cuda_host/emulate.cpp")
        subprocess.run([CXX, *FLAGS, *flags, "-o", str(out[name]), src], check=True, capture_output=True, text=True)
    return out


def _region_of(ptr: int, regions: list[torch.Tensor]) -> int:
    for r, t in enumerate(regions):
        if t.data_ptr() <= ptr < t.data_ptr() + t.untyped_storage().nbytes():
            return r
    raise AssertionError(f"plan address {ptr:#x} is in no region")


def emulate(binary: Path, items, seeds, coeffs, noise="gaussian", scales=None, max_blocks=0, tmp=None) -> str:
    """Run es_update_many_(items, seeds, coeffs) through the emulated CUDA kernel, in place.  Every item's
    tensor must be a view of a contiguous base tensor (its region); returns the emulator's stdout."""
    unit_groups = int(subprocess.run([str(binary), "--unit-groups"], capture_output=True, text=True).stdout)
    fam = NoiseFamily.parse(noise)
    seed_arr, coeff32 = ops.check_members(seeds, coeffs)
    checked, bits, _, device = _check_items(items, fam, len(seed_arr), scales, "cpu")
    steps = build_steps(checked, fam, len(seed_arr), bits, device, unit_groups)
    regions = []
    for w, _, _ in items:
        if not any(w.untyped_storage().data_ptr() == r.data_ptr() for r in regions):
            regions.append(w._base if w._base is not None else w)
    regions += [st.zero for st in steps if st.zero is not None and all(st.zero is not r for r in regions)]
    words = [struct.pack("<q", len(regions))]
    for t in regions:
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        words += [struct.pack("<q", len(raw)), raw + b"\0" * (-len(raw) % 8)]
    c = coeff32.tobytes()
    words += [struct.pack("<q", len(seed_arr)), seed_arr.tobytes(), c + b"\0" * (-len(c) % 8)]
    launches = []
    for st in steps:
        f = plan_fields(st.table)
        table = st.table.copy()
        tf = plan_fields(table)
        for name in ("data", "stage_a", "stage_b"):
            for k, ptr in enumerate(f[name]):
                if ptr:
                    r = _region_of(int(ptr), regions)
                    tf[name][k] = ((r + 1) << 44) | (int(ptr) - regions[r].data_ptr())
        zero = next((k for k, r in enumerate(regions) if st.zero is r), -1)
        for g, (e0, e1) in enumerate(st.groups):
            launches.append((zero if g == 0 else -1, int(st.ones), table[e0:e1]))
    words += [struct.pack("<q", max_blocks), struct.pack("<q", len(launches))]
    for zero, ones, rows in launches:
        words += [struct.pack("<qqq", zero, ones, len(rows)), np.ascontiguousarray(rows).tobytes()]
    src, dst = tmp / "in.bin", tmp / "out.bin"
    src.write_bytes(b"".join(words))
    res = subprocess.run([str(binary), str(src), str(dst)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    data, at = dst.read_bytes(), 0
    for t in regions:
        (size,) = struct.unpack_from("<q", data, at)
        at += 8
        if size:
            t.view(torch.uint8).copy_(torch.frombuffer(bytearray(data[at : at + size]), dtype=torch.uint8))
        at += size
    return res.stdout


def _guarded(shape, dtype, gen, cols_stride=None):
    """A tensor of `shape` inside a flat base tensor with GUARD elements of -7 on each side (and, with
    cols_stride, a row stride wider than its columns).  Returns (view, base)."""
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    stride = cols_stride or cols
    base = torch.full((2 * GUARD + rows * stride,), -7.0, dtype=dtype)
    body = base[GUARD : GUARD + rows * stride].view(rows, stride)
    body.copy_(torch.randn(rows, stride, generator=gen).to(dtype))
    view = body[:, :cols]
    return (view.reshape(shape) if len(shape) == 1 else view), base


def _case(seed: int):
    """Items of every dtype in one call: a long tensor (several launch units, NaNs, collapsed rows), a
    column slice with an unaligned Block start, a 1-D tensor whose logical indices end at 2^64 - 2, and
    one that ends 2 elements before a unit boundary (the bound of the hot loop), and a long one whose
    logical start leaves its units misaligned in memory (the hot loop's alignment test)."""
    g = torch.Generator().manual_seed(seed)
    dts = [torch.float32, torch.float16, torch.bfloat16]
    dts = dts[seed % 3 :] + dts[: seed % 3]
    a, base_a = _guarded((3, 4100), dts[0], g)
    a[1, 17] = float("nan")
    a.view(-1)[5000] = float("inf")
    b, base_b = _guarded((5, 39), dts[1], g, cols_stride=64)
    c, base_c = _guarded((131,), dts[2], g)
    d, base_d = _guarded((2 * 4096 - 2,), dts[0], g)  # a unit, then one 2 elements short of whole
    e, base_e = _guarded((9000,), dts[1], g)  # long, and its logical start 1 leaves every unit misaligned
    items = [
        (d, 5, None),
        (e, 6, ops.Block(col_offset=1, logical_cols=9001)),
        (a, 7, None),
        (b, 2**63 + 5, ops.Block(row_offset=2, col_offset=3, logical_rows=9, logical_cols=101)),
        (c, 2**64 - 1, ops.Block(col_offset=2**64 - 131 - 2, logical_cols=2**64 - 2)),
    ]
    return items, [base_a, base_b, base_c, base_d, base_e]


def _twin(items, bases):
    """The same items over clones of the bases (for the CPU backend)."""
    clones = [b.clone() for b in bases]
    out = []
    for w, key, blk in items:
        k = next(i for i, b in enumerate(bases) if w.untyped_storage().data_ptr() == b.data_ptr())
        off = (w.data_ptr() - bases[k].data_ptr()) // w.element_size()
        out.append((clones[k].as_strided(w.shape, w.stride(), off), key, blk))
    return out, clones


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("noise", ["gaussian", "rademacher", "lowrank:2"])
@pytest.mark.parametrize("members", [1, 3])
@pytest.mark.parametrize("max_blocks", [0, 1, 5])
def test_emulated_cuda_kernel_equals_the_cpu_backend(emulator, tmp_path, noise, members, max_blocks):
    items, bases = _case(members + max_blocks)
    twin, clones = _twin(items, bases)
    before = [b.clone() for b in bases]
    seeds = [2**64 - 1 - 977 * k for k in range(members)]
    coeffs = [(-1) ** k * (0.5 + k) * 1e-2 for k in range(members)]
    scales = [0.5, 2.0, 1.0, 0.25, 3.0]
    out = emulate(emulator["plain"], items, seeds, coeffs, noise, scales, max_blocks, tmp_path)
    ops.es_update_many_(twin, seeds, coeffs, noise=noise, scales=scales, backend="cpu")
    for b, cl, b0 in zip(bases, clones, before):
        assert _same(b[:GUARD], b0[:GUARD]) and _same(b[-GUARD:], b0[-GUARD:])  # guard bands untouched
        assert _same(b, cl)  # bit for bit the CPU backend
        assert not _same(b, b0)  # and the call did something
    _, launches, _, blocks = out.split()
    assert int(launches) >= 3  # one per dtype present (lowrank: a staging fill and an apply per dtype)
    if max_blocks:
        assert int(blocks) <= max_blocks * int(launches)


@pytest.mark.parametrize("noise", ["gaussian", "rademacher", "lowrank:2"])
def test_emulated_cuda_kernel_under_asan_and_ubsan(emulator, tmp_path, noise):
    items, bases = _case(2)
    twin, clones = _twin(items, bases)
    emulate(emulator["sanitized"], items, [11, 2**63], [3e-3, -0.75], noise, None, 3, tmp_path)
    ops.es_update_many_(twin, [11, 2**63], [3e-3, -0.75], noise=noise, backend="cpu")
    assert all(_same(b, c) for b, c in zip(bases, clones))


def test_emulated_grid_is_the_real_one_or_the_forced_one(emulator, tmp_path):
    """The emulator runs min(units, 2^30) blocks, or the forced grid: the grid-stride loop then covers the
    units a smaller grid leaves (an off-by-one in it would leave elements unperturbed: the equality
    test above fails)."""
    w = torch.zeros(10 * 4096)
    units = ops.units_per_row(len(w), ops.FAMILY_CODES["gaussian"], 1024)
    full = emulate(emulator["plain"], [(w, 1, None)], [1], [1.0], tmp=tmp_path)
    assert full.split() == ["launches", "1", "blocks", str(int(units))]
    w.zero_()
    forced = emulate(emulator["plain"], [(w, 1, None)], [1], [1.0], max_blocks=3, tmp=tmp_path)
    assert forced.split() == ["launches", "1", "blocks", "3"] and bool((w != 0).all())


def test_the_emulator_refuses_a_plan_that_is_not_the_kernels(emulator, tmp_path):
    """A plan whose units_per_row is not the kernel's is refused (as apply_many_cuda refuses it)."""
    w = torch.zeros(4096)
    fam = NoiseFamily.parse("gaussian")
    checked, bits, _, dev = _check_items([(w, 1, None)], fam, 1, None, "cpu")
    (st,) = build_steps(checked, fam, 1, bits, dev, 512)  # half the kernel's unit
    rows = st.table.copy()
    plan_fields(rows)["data"] = (1 << 44) | 0
    raw = w.view(torch.uint8).numpy().tobytes()
    blob = struct.pack("<qq", 1, len(raw)) + raw + struct.pack("<q", 1) + np.uint64(1).tobytes()
    blob += np.float32(1.0).tobytes() + b"\0" * 4 + struct.pack("<qqqqq", 0, 1, -1, 0, 1) + rows.tobytes()
    (tmp_path / "in.bin").write_bytes(blob)
    res = subprocess.run([str(emulator["plain"]), str(tmp_path / "in.bin"), str(tmp_path / "o")], capture_output=True)
    assert res.returncode == 4 and b"units_per_row" in res.stderr
