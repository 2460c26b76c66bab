"""Bad input gets a clear error that names the problem, and the weights stay untouched."""

import math

import numpy as np
import pytest
import torch

from espert import ops
from espert.update import Update


def _w():
    return (torch.randn(8, 16) * 0.02).to(torch.bfloat16)


CASES = [
    ("dtype", lambda w: ops.perturb_(w.to(torch.float64), 1, 2, 1e-3), TypeError, "unsupported dtype"),
    ("int dtype", lambda w: ops.perturb_(torch.zeros(4, dtype=torch.int8), 1, 2, 1e-3), TypeError, "unsupported dtype"),
    ("not a tensor", lambda w: ops.perturb_([1.0], 1, 2, 1e-3), TypeError, "torch.Tensor"),
    ("transposed", lambda w: ops.perturb_(w.t(), 1, 2, 1e-3), ValueError, "unit stride"),
    (
        "non-contiguous 3d",
        lambda w: ops.perturb_(torch.zeros(4, 4, 4).transpose(0, 1), 1, 2, 1e-3),
        ValueError,
        "contiguous",
    ),
    ("0-d", lambda w: ops.perturb_(torch.tensor(1.0), 1, 2, 1e-3), ValueError, "0-d"),
    ("sigma 0", lambda w: ops.perturb_(w, 1, 2, 0.0), ValueError, "sigma"),
    ("sigma < 0", lambda w: ops.perturb_(w, 1, 2, -1e-3), ValueError, "sigma"),
    ("sigma nan", lambda w: ops.perturb_(w, 1, 2, math.nan), ValueError, "sigma"),
    ("sigma inf", lambda w: ops.perturb_(w, 1, 2, math.inf), ValueError, "sigma"),
    ("sign", lambda w: ops.perturb_(w, 1, 2, 1e-3, sign=2), ValueError, "sign"),
    ("sign bool", lambda w: ops.perturb_(w, 1, 2, 1e-3, sign=True), ValueError, "sign"),
    ("sign float", lambda w: ops.perturb_(w, 1, 2, 1e-3, sign=-1.0), ValueError, "sign"),
    ("sign numpy int", lambda w: ops.perturb_(w, 1, 2, 1e-3, sign=np.int64(1)), ValueError, "sign"),
    ("sigma 0 in float32", lambda w: ops.perturb_(w, 1, 2, 1e-50), ValueError, "float32"),
    ("sigma subnormal in float32", lambda w: ops.perturb_(w, 1, 2, 1e-40), ValueError, "subnormal"),
    ("sigma bool", lambda w: ops.perturb_(w, 1, 2, True), ValueError, "sigma"),
    (
        "block float",
        lambda w: ops.perturb_(w, 1, 2, 1e-3, block=ops.Block(1.0, 0, 10, 16)),
        TypeError,
        r"Block.row_offset must be an int",
    ),
    (
        "block bool",
        lambda w: ops.perturb_(w, 1, 2, 1e-3, block=ops.Block(0, 0, True, 16)),
        TypeError,
        r"Block.logical_rows must be an int",
    ),
    ("block not a Block", lambda w: ops.perturb_(w, 1, 2, 1e-3, block=(0, 0, 8, 16)), TypeError, "Block"),
    ("scale 0", lambda w: ops.perturb_many_([(w, 2, None)], 1, 1e-3, scales=[0.0]), ValueError, r"scales\[0\]"),
    ("scale nan", lambda w: ops.perturb_many_([(w, 2, None)], 1, 1e-3, scales=[math.nan]), ValueError, "scales"),
    ("item not a triple", lambda w: ops.perturb_many_([(w, 2)], 1, 1e-3), TypeError, "triple"),
    ("items not a sequence", lambda w: ops.perturb_many_(w, 1, 1e-3), TypeError, "sequence"),
    ("noise family", lambda w: ops.perturb_(w, 1, 2, 1e-3, noise="uniform"), ValueError, "unknown noise family"),
    ("seed < 0", lambda w: ops.perturb_(w, -1, 2, 1e-3), ValueError, r"seeds\[0\]"),
    ("seed >= 2^64", lambda w: ops.perturb_(w, 2**64, 2, 1e-3), ValueError, r"seeds\[0\]"),
    ("seed float", lambda w: ops.perturb_(w, 1.5, 2, 1e-3), TypeError, r"seeds\[0\]"),
    ("key", lambda w: ops.perturb_(w, 1, -5, 1e-3), ValueError, "key"),
    ("length mismatch", lambda w: ops.es_update_(w, [1, 2, 3], [0.1, 0.2], 2), ValueError, "3 seeds but 2"),
    ("nan coeff", lambda w: ops.es_update_(w, [1, 2], [0.1, math.nan], 2), ValueError, "finite"),
    ("inf coeff", lambda w: ops.es_update_(w, [1, 2], [math.inf, 0.1], 2), ValueError, "finite"),
    ("coeff overflow", lambda w: ops.es_update_(w, [1], [1e300], 2), ValueError, "overflow"),
    ("negative offset", lambda w: ops.perturb_(w, 1, 2, 1e-3, block=ops.Block(-1, 0, 10, 16)), ValueError, "outside"),
    ("rows out of range", lambda w: ops.perturb_(w, 1, 2, 1e-3, block=ops.Block(3, 0, 10, 16)), ValueError, "outside"),
    ("cols out of range", lambda w: ops.perturb_(w, 1, 2, 1e-3, block=ops.Block(0, 1, 8, 16)), ValueError, "outside"),
    ("unknown backend", lambda w: ops.perturb_(w, 1, 2, 1e-3, backend="metal"), ValueError, "unknown backend"),
    ("cuda backend on cpu", lambda w: ops.perturb_(w, 1, 2, 1e-3, backend="cuda"), ValueError, "cannot run"),
    ("restore shape", lambda w: ops.restore_(w, torch.zeros(8, 15)), ValueError, "shape"),
    ("restore dtype", lambda w: ops.restore_(w, torch.zeros(8, 16, dtype=torch.float64)), TypeError, "center dtype"),
]


@pytest.mark.parametrize("name,call,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_and_leaves_weights_untouched(name, call, exc, match):
    w = _w()
    before = w.clone()
    with pytest.raises(exc, match=match):
        call(w)
    assert torch.equal(w.view(torch.int16), before.view(torch.int16))


def test_center_store_update_rejects_bad_members_before_touching_anything():
    from espert.center import CenterStore
    from espert.params import torch_param_views

    m = torch.nn.Linear(16, 8).to(torch.bfloat16)
    store = CenterStore(torch_param_views(m))
    centers = [c.clone() for c in store.centers]
    live = [p.detach().clone() for p in m.parameters()]
    for seeds, coeffs in (([1, 2], [0.1]), ([1, 2], [0.1, math.nan]), ([-1], [0.1])):
        with pytest.raises(ValueError):
            store.update(Update(seeds, coeffs))
    assert all(torch.equal(a, b) for a, b in zip(centers, store.centers))
    assert all(torch.equal(a, b) for a, b in zip(live, m.parameters()))


def test_center_store_load_checks_before_writing():
    from espert.center import CenterStore
    from espert.params import torch_param_views

    m = torch.nn.Linear(4, 4)
    store = CenterStore(torch_param_views(m))
    before = [c.clone() for c in store.centers]
    bad = {"weight": torch.zeros(4, 4), "bias": torch.zeros(5)}
    with pytest.raises(ValueError, match="bias"):
        store.load_state_dict(bad)
    with pytest.raises(KeyError, match="bias"):
        store.load_state_dict({"weight": torch.zeros(4, 4)})
    assert all(torch.equal(a, b) for a, b in zip(before, store.centers))


def test_param_views_reject_unsupported_dtypes_and_empty_selection():
    from espert.params import torch_param_views

    m = torch.nn.Linear(4, 4).to(torch.float64)
    with pytest.raises(ValueError, match="float64"):
        torch_param_views(m)
    with pytest.raises(ValueError, match="no parameters selected"):
        torch_param_views(torch.nn.Linear(4, 4), include=["nothing*"])


def test_block_fields_accept_numpy_integers():
    """numpy integers are converted to int (the Triton launch and the plan need Python ints)."""
    b = ops.Block(np.int64(2), np.uint32(3), np.int32(10), np.int64(20))
    assert (b.row_offset, b.col_offset, b.logical_rows, b.logical_cols) == (2, 3, 10, 20)
    assert all(type(v) is int for v in (b.row_offset, b.col_offset, b.logical_rows, b.logical_cols))
    w = torch.zeros(8, 16)
    ops.perturb_(w, 1, 2, 1e-3, block=ops.Block(np.int64(2), 0, np.int64(10), 16))
    assert w.abs().sum() > 0
