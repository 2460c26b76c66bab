"""espert.ops against the numpy reference, bit for bit, on every backend that runs here."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import bits, ref_bits, to_ref, weights

from espert import noise, ops
from espert.ops.checks import geometry

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BACKENDS = ["cpu", "triton"]
KEY = noise.param_key("model.layers.3.mlp.up_proj.weight")


def _check_update(w, seeds, coeffs, block=None, backend="cpu"):
    ref_in, name = to_ref(w)
    g = geometry(w, block)
    ref = noise.update_reference(
        ref_in.reshape(g.rows, g.cols), name, seeds, coeffs, KEY, g.row_offset, g.col_offset, g.logical_cols
    )
    ops.es_update_(w, seeds, coeffs, KEY, block=block, backend=backend)
    np.testing.assert_array_equal(bits(w).reshape(g.rows, g.cols), ref_bits(ref))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_perturb_matches_reference(backend, dtype, rng):
    w = weights((33, 70), dtype, rng, specials=True)
    for sign in (1, -1):
        _check_update(w, [17], [sign * 1e-3], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_update_matches_reference(backend, dtype, rng):
    w = weights((5, 301), dtype, rng)
    _check_update(w, [1, 2**64 - 1, 3, 2**40, 5], [1e-4, -3e-4, 2.5e-4, 0.0, -1e-5], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_with_odd_offsets_and_strided_rows(backend, rng):
    big = weights((20, 67), torch.bfloat16, rng)
    view = big[3:11, 5:40]  # row stride 67, not contiguous
    _check_update(view, [7], [-1e-3], block=ops.Block(103, 9, 500, 77), backend=backend)
    untouched = big.clone()
    untouched[3:11, 5:40] = view
    assert torch.equal(untouched, big)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_dim_and_three_dim_and_huge_offsets(backend, rng):
    _check_update(weights((1001,), torch.float16, rng), [9], [1e-2], backend=backend)
    _check_update(weights((3, 4, 10), torch.float32, rng), [9, 10], [1e-2, 2e-2], backend=backend)
    _check_update(
        weights((2, 50), torch.bfloat16, rng),
        [4],
        [1e-3],
        block=ops.Block(2**31 + 7, 2**31 + 3, 2**31 + 100, 2**32 + 1),
        backend=backend,
    )


def test_shards_compose_to_the_whole(rng):
    """Tensor-parallel shards and fused rows get exactly the noise of their logical elements."""
    whole = weights((64, 96), torch.bfloat16, rng)
    parts = whole.clone()
    ops.perturb_(whole, 11, KEY, 1e-3)
    for r0, r1 in ((0, 24), (24, 64)):
        for c0, c1 in ((0, 45), (45, 96)):
            shard = parts[r0:r1, c0:c1].clone()
            ops.perturb_(shard, 11, KEY, 1e-3, block=ops.Block(r0, c0, 64, 96))
            parts[r0:r1, c0:c1] = shard
    assert torch.equal(parts, whole)


def test_cpu_isa_paths_agree(rng):
    """The AVX-512 and the generic CPU code paths produce identical bits."""
    script = (
        "import torch, numpy as np; from espert import ops, _C;"
        "w=torch.linspace(-1,1,10007).reshape(1,-1).to(torch.bfloat16);"
        "ops.es_update_(w,[1,2,3],[1e-3,-2e-3,5e-4],77);"
        "print(_C.cpu_isa(), w.view(torch.int16).numpy().tobytes().hex())"
    )
    outs = {}
    for isa in ("generic", "native"):
        env = dict(os.environ, ESPERT_CPU_ISA=isa)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        name, data = out.stdout.split()
        outs[name] = data
    assert "generic" in outs
    assert len(set(outs.values())) == 1, outs.keys()


def test_backends_agree_with_each_other(rng):
    w = weights((16, 513), torch.bfloat16, rng)
    a, b = w.clone(), w.clone()
    ops.es_update_(a, list(range(8)), np.linspace(-1e-3, 1e-3, 8), KEY, backend="cpu")
    ops.es_update_(b, list(range(8)), np.linspace(-1e-3, 1e-3, 8), KEY, backend="triton")
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_restore_rounds_like_a_cast(rng):
    center = torch.randn(3000, generator=rng) * 0.02
    for dtype in (torch.bfloat16, torch.float16):
        w = torch.empty(3000, dtype=dtype)
        ops.restore_(w, center)
        assert torch.equal(w, center.to(dtype))
        ref_in, _ = to_ref(center)
        if dtype == torch.bfloat16:
            np.testing.assert_array_equal(bits(w), noise.f32_to_bf16_bits(ref_in))


def test_restore_strided_view(rng):
    big = torch.zeros(10, 20)
    center = torch.randn(10, 7, generator=rng)
    ops.restore_(big[:, 3:10], center)
    assert torch.equal(big[:, 3:10], center) and big[:, :3].abs().sum() == 0 and big[:, 10:].abs().sum() == 0


def test_cpu_kernels_follow_torch_thread_count():
    """espert's OpenMP runtime is not torch's: the op surface forwards torch.set_num_threads."""
    from espert import _C

    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ops.perturb_(torch.zeros(16), 1, 2, 1e-3)
        assert _C.get_num_threads() == 1
        torch.set_num_threads(2)
        ops.perturb_(torch.zeros(16), 1, 2, 1e-3)
        assert _C.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)


# ---- multi-tensor ops, counters, NaN bits, index range, autograd -----------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_launches_and_uploads_do_not_grow_with_the_number_of_tensors(backend, rng):
    """One op call makes the same launches and host-to-device copies for 300 tensors as for one."""
    n = 300 if backend == "cpu" else 12  # the Triton interpreter runs each program in Python
    many = [weights((3, 5 + i % 7), torch.bfloat16, rng) for i in range(n)]
    one = [weights((n, 8), torch.bfloat16, rng)]
    counts = []
    for ws in (one, many):
        items = [(w, noise.param_key(f"p{i}"), None) for i, w in enumerate(ws)]
        with ops.counting() as c:
            ops.perturb_many_(items, 7, 1e-3, backend=backend)
            ops.es_update_many_(items, list(range(4)), [1e-3] * 4, backend=backend)
        counts.append(dict(c))
    assert counts[0] == counts[1], counts
    assert counts[1]["launches"] == 2
    assert counts[1]["h2d"] == (0 if backend == "cpu" else 2)


def test_many_validates_every_tensor_before_writing(rng):
    good = [weights((4, 8), torch.bfloat16, rng) for _ in range(3)]
    before = [w.clone() for w in good]
    bad_block = ops.Block(0, 0, 4, 7)  # the third tensor does not fit its logical shape
    with pytest.raises(ValueError, match="outside"):
        ops.perturb_many_([(good[0], 1, None), (good[1], 2, None), (good[2], 3, bad_block)], 5, 1e-2)
    with pytest.raises(ValueError, match="twice"):
        ops.perturb_many_([(good[0], 1, None), (good[0], 2, None)], 5, 1e-2)
    with pytest.raises(ValueError, match="scales"):
        ops.perturb_many_([(good[0], 1, None)], 5, 1e-2, scales=[1.0, 2.0])
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(good, before))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_elements_keep_their_bits(backend, dtype):
    """perturb and update store a NaN input's own bits (signaling, quiet, payloads, both signs)."""
    if dtype == torch.float32:
        nans = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0xFFC12345, 0x7FBFFFFF], np.uint32)
        w = torch.from_numpy(np.resize(nans, 5 * 40).view(np.float32).reshape(5, 40).copy())
    else:
        nans = np.array(
            [0x7F81, 0xFF81, 0x7FC0, 0xFFC5, 0x7FFF]
            if dtype == torch.bfloat16
            else [0x7C01, 0xFC01, 0x7E00, 0xFE05, 0x7FFF],
            np.uint16,
        )
        w = torch.from_numpy(np.resize(nans, 5 * 40).view(np.int16).reshape(5, 40).copy()).view(dtype)
    before = bits(w)
    ops.perturb_(w, 3, KEY, 0.5, backend=backend)
    ops.es_update_(w, [1, 2, 3], [0.1, -0.2, 0.3], KEY, backend=backend)
    np.testing.assert_array_equal(bits(w), before)


def test_logical_indices_up_to_2_pow_64_are_reached(rng):
    """The last 64 logical indices (where tile arithmetic used to overflow) get their noise."""
    for cols in (5, 64, 130):
        w = weights((1, cols), torch.float32, rng)
        _check_update(w, [3, 4], [0.5, -0.25], block=ops.Block(0, 2**64 - 1 - cols, 1, 2**64 - 1))


def test_unknown_codes_are_errors_not_no_ops():
    """Every C++ switch is guarded: a plan with an unknown dtype or family code raises before writing."""
    from espert import _C

    w = torch.ones(4, 8)
    F = {n: i for i, n in enumerate(_C.PLAN_FIELDS)}
    base = np.zeros(len(_C.PLAN_FIELDS), np.int64)
    base[F["data"]], base[F["rows"]], base[F["cols"]], base[F["row_stride"]] = w.data_ptr(), 4, 8, 8
    base[F["logical_cols"]], base[F["member_end"]] = 8, 1
    base[F["scale_bits"]] = np.float32(1.0).view(np.int32)
    seeds, coeffs = np.array([1], np.uint64), np.array([1.0], np.float32)
    assert set(_C.DTYPE_CODES) == {"float32", "float16", "bfloat16"}
    assert ops.DTYPE_CODES[torch.bfloat16] == _C.DTYPE_CODES["bfloat16"]
    for field, bad in (("dtype", 3), ("dtype", -1), ("family", len(_C.FAMILY_CODES)), ("family", 99)):
        t = base.copy()[None, :]
        t[0, F[field]] = bad
        with pytest.raises(ValueError, match="unknown"):
            _C.apply_many_cpu(t.ctypes.data, 1, seeds.ctypes.data, coeffs.ctypes.data, 1)
    assert torch.equal(w, torch.ones(4, 8))


@pytest.mark.parametrize("op", ["perturb", "update", "many"])
def test_in_place_ops_bump_the_autograd_version(op):
    """backward() through a weight edited in place raises torch's in-place error, as torch's own ops do."""
    p = torch.nn.Parameter(torch.randn(4, 8))
    y = p.pow(2).sum()  # saves p for backward
    w = p.detach()  # shares the version counter with p
    if op == "perturb":
        ops.perturb_(w, 1, KEY, 1e-2)
    elif op == "update":
        ops.es_update_(w, [1, 2], [1e-2, 2e-2], KEY)
    else:
        ops.perturb_many_([(w, KEY, None)], 1, 1e-2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_upload_regions_are_16_byte_aligned_for_any_member_count(n):
    """Before: with an odd number of members the coefficients started 8 bytes into a 16-byte word, so
    Triton (which specializes kernels on 16-byte pointer alignment) compiled a variant per parity."""
    from espert.ops.backends import upload
    from espert.ops.plan import Step

    seeds = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(2**63 + 7)
    coeffs = np.linspace(-1, 1, n).astype(np.float32)
    tables = [np.arange(3 * 5, dtype=np.int64).reshape(3, 5), np.arange(7, dtype=np.int64).reshape(1, 7)]
    s, c, o, t, members = upload(torch.device("cpu"), [Step(x, False, []) for x in tables], seeds, coeffs)
    for view in (s, c, o, *t, members):
        assert view.data_ptr() % 16 == 0
    assert s.numpy().view(np.uint64).tolist() == seeds.tolist()
    assert c.tolist() == coeffs.tolist() and o.tolist() == [1.0] * n
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(t, tables))
