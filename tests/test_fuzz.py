"""Property-based fuzzing of the op surface and the center stores (hypothesis).

Two properties, on random shapes, strides, dtypes, Blocks, seeds, coefficients and bad values:
- after any error, weights, centers and masters are bit-identical to what they were;
- after any accepted call, the result equals the numpy reference bit for bit.
"""

import math

import numpy as np
import pytest
import torch
from conftest import bits, ref_bits, to_ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from espert import noise, ops
from espert.center import CenterStore
from espert.ops.checks import geometry
from espert.params import ParamView
from espert.quant import QuantCenterStore, QuantParamView, quantize_weight
from espert.update import Update

FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
U64 = 2**64

seeds_st = st.one_of(st.integers(0, U64 - 1), st.sampled_from([-1, U64, 1.5, True, "7", None]))
coeff_st = st.one_of(st.floats(-1e-2, 1e-2, allow_nan=False), st.sampled_from([math.nan, math.inf, 1e39, -1e-50]))
sigma_st = st.one_of(st.floats(1e-6, 1e-1), st.sampled_from([0.0, -1e-3, math.nan, math.inf, 1e-50, True, "0.1"]))
sign_st = st.sampled_from([1, -1, 1, -1, 0, 2, True, -1.0, np.int64(1)])
offset_st = st.one_of(st.integers(0, 2**40), st.sampled_from([-1, 1.0, np.int64(3), 2**63]))


@st.composite
def weight_st(draw):
    """A weight tensor in one of the layouts users hand us (some of which ops must refuse)."""
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["2d", "1d", "3d", "rows_view", "transposed", "permuted", "empty"]))
    r, c = draw(st.integers(1, 9)), draw(st.integers(1, 70))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    base = (torch.randn(2 * r + 3, c + 5, generator=g) * 0.02).to(dtype)
    if kind == "2d":
        return base[:r, :c].contiguous()
    if kind == "1d":
        return base.reshape(-1)[: r * c].clone()
    if kind == "3d":
        return base.reshape(-1)[: 2 * r * c].clone().reshape(2, r, c)
    if kind == "rows_view":
        return base[1 : r + 1, 2 : c + 2]  # row stride c + 5
    if kind == "transposed":
        return base[:r, :c].t()
    if kind == "permuted":
        return base.reshape(-1)[: 2 * r * c].reshape(2, r, c).permute(1, 0, 2)
    return torch.empty(0, c, dtype=dtype)


@st.composite
def block_st(draw, w):
    if draw(st.booleans()):
        return None
    rows, cols = (1, w.shape[0]) if w.dim() == 1 else (w.numel() // max(1, w.shape[-1]), w.shape[-1])
    ro, co = draw(offset_st), draw(offset_st)
    lr = draw(st.one_of(st.none(), st.integers(0, 2**41)))
    lc = draw(st.one_of(st.none(), st.integers(0, 2**41)))
    if draw(st.booleans()) and all(isinstance(x, int) for x in (ro, co)):  # mostly valid blocks
        ro, co = ro % 1000, co % 1000
        lr, lc = ro + rows + draw(st.integers(0, 5)), co + cols + draw(st.integers(0, 5))
    return (ro, co, lr, lc)  # built inside the call under test: Block validates its own fields


def _block(spec):
    return None if spec is None else ops.Block(*spec)


def _expected(w, seeds, coeffs, key, block):
    g = geometry(w, block)
    ref_in, name = to_ref(w)
    with np.errstate(over="raise"):  # a coefficient that overflows float32 cannot be evaluated
        c32 = [float(np.float32(c)) for c in coeffs]
    out = noise.update_reference(
        ref_in.reshape(g.rows, g.cols),
        name,
        [int(s) for s in seeds],
        c32,
        key,
        g.row_offset,
        g.col_offset,
        g.logical_cols,
    )
    return ref_bits(out).reshape(-1)


@FUZZ
@given(data=st.data())
def test_es_update_fuzz(data):
    w = data.draw(weight_st())
    block = data.draw(block_st(w))
    n = data.draw(st.integers(0, 4))
    seeds = data.draw(st.lists(seeds_st, min_size=n, max_size=n + data.draw(st.integers(0, 1))))
    coeffs = data.draw(st.lists(coeff_st, min_size=n, max_size=n))
    key = data.draw(st.one_of(st.integers(0, U64 - 1), st.sampled_from([-5, U64, 2.0])))
    before = bits(w)
    try:
        expected = _expected(w, seeds, coeffs, key, _block(block))
    except Exception:  # noqa: BLE001 - the reference refuses too: the op must refuse
        expected = None
    try:
        ops.es_update_(w, seeds, coeffs, key, block=_block(block))
    except (ValueError, TypeError) as e:
        assert str(e)
        np.testing.assert_array_equal(bits(w), before)
        return
    assert expected is not None, "the op accepted a call the reference cannot evaluate"
    np.testing.assert_array_equal(bits(w).reshape(-1), expected)


@FUZZ
@given(data=st.data())
def test_perturb_fuzz(data):
    w = data.draw(weight_st())
    block = data.draw(block_st(w))
    seed, sigma, sign = data.draw(seeds_st), data.draw(sigma_st), data.draw(sign_st)
    before, orig = bits(w), w.clone()
    try:
        ops.perturb_(w, seed, 99, sigma, sign, block=_block(block))
    except (ValueError, TypeError) as e:
        assert str(e)
        np.testing.assert_array_equal(bits(w), before)
        return
    assert isinstance(sign, int) and not isinstance(sign, bool) and sign in (1, -1)
    assert isinstance(seed, int) and not isinstance(seed, bool)
    assert float(np.float32(sigma)) > 0 and math.isfinite(sigma)
    np.testing.assert_array_equal(bits(w).reshape(-1), _expected(orig, [seed], [sign * sigma], 99, _block(block)))


@FUZZ
@given(data=st.data())
def test_restore_fuzz(data):
    w = data.draw(weight_st())
    cdtype = data.draw(st.sampled_from([torch.float32, w.dtype, torch.float64, torch.int32]))
    shape = data.draw(st.sampled_from([tuple(w.shape), (w.numel() + 1,), tuple(reversed(w.shape))]))
    center = (torch.randn(shape) * 0.02).to(cdtype)
    if data.draw(st.booleans()) and center.dim() == 2:
        center = center.t().contiguous().t()  # same shape, not contiguous
    before = bits(w)
    try:
        ops.restore_(w, center)
    except (ValueError, TypeError) as e:
        assert str(e)
        np.testing.assert_array_equal(bits(w), before)
        return
    np.testing.assert_array_equal(bits(w), bits(ops.cast_exact_(torch.empty(w.shape, dtype=w.dtype), center)))


@st.composite
def views_st(draw):
    n = draw(st.integers(1, 4))
    views = []
    for i in range(n):
        w = draw(weight_st())
        spec = draw(block_st(w))
        views.append((f"p{i}.weight", w, spec))
    return views


def _state(store):
    return [c.clone() for c in store.centers], [bits(v.tensor) for v in store.views]


def _same(store, snap):
    centers, live = snap
    return all(torch.equal(a, b) for a, b in zip(centers, store.centers)) and all(
        np.array_equal(a, bits(v.tensor)) for a, v in zip(live, store.views)
    )


def _member_call(store, data, op, decays):
    """perturb (then restore) or update of a center with drawn, often invalid, arguments."""
    if op == "perturb":
        store.perturb(data.draw(seeds_st), data.draw(sigma_st), data.draw(sign_st))
        store.restore()
        return
    n = data.draw(st.integers(0, 3))
    store.update(
        Update(
            data.draw(st.lists(seeds_st, min_size=n, max_size=n)),
            data.draw(st.lists(coeff_st, min_size=n, max_size=n)),
            decay=data.draw(st.sampled_from(decays)),
        )
    )


@FUZZ
@given(data=st.data())
def test_center_store_fuzz(data):
    specs = data.draw(views_st())
    before = [bits(w) for _, w, _ in specs]
    try:
        views = [ParamView(name, w, _block(spec)) for name, w, spec in specs]
        store = CenterStore(views)
    except (ValueError, TypeError) as e:
        assert str(e)
        assert all(np.array_equal(b, bits(w)) for b, (_, w, _) in zip(before, specs))
        return
    for _ in range(3):
        op = data.draw(st.sampled_from(["perturb", "update", "scale", "load"]))
        snap = _state(store)
        try:
            if op in ("perturb", "update"):
                _member_call(store, data, op, [1.0, 0.999, 0.0, math.nan])
            elif op == "scale":
                store.scale(data.draw(st.sampled_from([0.5, 1.0, -1.0, math.inf])))
                store.restore()  # scale leaves the live weights to the next restore
            else:
                state = {k: v.clone() for k, v in store.state_dict().items()}
                victim = data.draw(st.sampled_from(sorted(state)))
                state[victim] = data.draw(
                    st.sampled_from(
                        [
                            state[victim] + 1,
                            torch.empty(state[victim].shape, device="meta"),
                            torch.zeros(state[victim].numel() + 1),
                        ]
                    )
                )
                store.load_state_dict(state)
        except (ValueError, TypeError, KeyError) as e:
            assert str(e)
            assert _same(store, snap), f"{op} raised {e!r} after mutating"
            continue
        # accepted: the live weights are at the (new) center, exactly
        for v, c in zip(store.views, store.centers):
            expect = ops.cast_exact_(torch.empty(c.shape, dtype=v.tensor.dtype), c)
            assert np.array_equal(bits(v.tensor), bits(expect)), op


@pytest.mark.parametrize("fmt", ["int8", "fp8", "gptq", "awq"])
@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_quant_center_store_fuzz(fmt, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    qws = [quantize_weight(torch.randn(16, 64, generator=gen) * 0.02, fmt, group_size=32) for _ in range(2)]
    store = QuantCenterStore([QuantParamView(f"q{i}.weight", q) for i, q in enumerate(qws)])
    for _ in range(3):
        snap = ([m.clone() for m in store.masters], [q.qweight.clone() for q in qws])
        op = data.draw(st.sampled_from(["perturb", "update", "load"]))
        try:
            if op in ("perturb", "update"):
                _member_call(store, data, op, [1.0, 0.99, -1.0])
            else:
                state = {k: v.clone() for k, v in store.state_dict().items()}
                victim = data.draw(st.sampled_from(sorted(state)))
                bad = state[victim].clone()
                bad.view(-1)[0] = data.draw(st.sampled_from([math.nan, math.inf, 3.0]))
                state[victim] = data.draw(st.sampled_from([bad, torch.empty(bad.shape, device="meta")]))
                store.load_state_dict(state)
        except (ValueError, TypeError, KeyError) as e:
            assert str(e)
            assert all(torch.equal(a, b) for a, b in zip(snap[0], store.masters)), op
            assert all(torch.equal(a, q.qweight) for a, q in zip(snap[1], qws)), op
            continue
        assert all(torch.equal(c, q.qweight) for c, q in zip(store.codes, qws)), op


@st.composite
def shared_views_st(draw):
    """1-4 views of one storage (disjoint, overlapping or identical, some with overlapping rows) and the
    storage element offsets each touches."""
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    storage = (torch.randn(160, generator=g) * 0.02).to(dtype)
    views = []
    for _ in range(draw(st.integers(1, 4))):
        rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 12))
        stride = draw(st.integers(max(1, cols - 2), cols + 8))
        off = draw(st.integers(0, 160 - ((rows - 1) * stride + cols)))
        if views and draw(st.integers(0, 4)) == 0:  # the same view again
            v, touched = views[draw(st.integers(0, len(views) - 1))]
            v = storage.as_strided(v.shape, v.stride(), v.storage_offset())
        else:
            v = storage.as_strided((rows, cols), (stride, 1), off)
            touched = {off + i * stride + j for i in range(rows) for j in range(cols)}
        views.append((v, touched))
    return storage, views


@pytest.mark.parametrize("surface", ["torch.ops.espert", "espert.ops"])
@FUZZ
@given(data=st.data())
def test_es_update_operator_fuzz(surface, data):
    """The torch operator (and the Python op on the same items): float seed tensors and views that share
    elements are refused with nothing written; any accepted call equals the reference, view by view."""
    storage, views = data.draw(shared_views_st())
    n = data.draw(st.integers(0, 3))
    seeds = data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n))
    coeffs = data.draw(st.lists(coeff_st, min_size=n, max_size=n + data.draw(st.integers(0, 1))))
    sdtype = data.draw(st.sampled_from([torch.int64, torch.int64, torch.float32, torch.float64, torch.int32]))
    cdtype = data.draw(st.sampled_from([torch.float64, torch.float32, torch.int64]))
    keys = [data.draw(st.integers(0, U64 - 1)) for _ in views]
    items = [(v, k, None) for (v, _), k in zip(views, keys)]
    before = bits(storage)
    u64 = [s % U64 for s in seeds]
    c_t = torch.tensor(coeffs, dtype=torch.float64).to(cdtype)
    c_list = coeffs if surface == "espert.ops" and cdtype == torch.int64 else c_t.tolist()
    disjoint = all(not (a & b) for i, (_, a) in enumerate(views) for _, b in views[i + 1 :])
    if surface == "espert.ops":  # lists: float seeds (x.5) when sdtype is not int64, float coefficients
        ok = disjoint and (sdtype == torch.int64 or n == 0) and len(coeffs) == n
    else:
        ok = disjoint and sdtype == torch.int64 and cdtype != torch.int64 and len(coeffs) == n
    if ok:
        try:
            expected = [_expected(v, u64, c_list, k, None) for (v, _), k in zip(views, keys)]
        except Exception:  # noqa: BLE001 - the reference refuses too (NaN, Inf, float32 overflow)
            ok = False
    try:
        if surface == "torch.ops.espert":
            s_t = torch.tensor(seeds, dtype=torch.int64).to(sdtype)
            torch.ops.espert.es_update_(*ops.checks.op_args(items), s_t, c_t)
        else:
            seeds_in = u64 if sdtype == torch.int64 else [float(s) + 0.5 for s in u64]
            ops.es_update_many_(items, seeds_in, c_list)
    except (ValueError, TypeError) as e:
        assert str(e)
        np.testing.assert_array_equal(bits(storage), before)
        return
    assert ok, "the operator accepted a call it must refuse"
    for (v, _), exp in zip(views, expected):
        np.testing.assert_array_equal(bits(v).reshape(-1), exp)
