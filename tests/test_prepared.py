"""ops.Prepared: a call planned and staged once, whose members switch by rewriting the staged seeds
(issue 21 §1.5).  Before it, every op uploaded seeds and table inside the call, so a CUDA graph that
captured one perturb replayed that seed forever.  Here: each member of a prepared object gives the
eager op's bits, apply() makes no host-to-device copy, and bad use is refused with one message."""

import numpy as np
import pytest
import torch

from espert import ops

BACKENDS = ["cpu", "triton"]


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(7, 33, generator=g).to(torch.bfloat16), 11, None),
        (torch.randn(130, generator=g), 2**64 - 5, None),
        (
            torch.randn(5, 64, generator=g).to(torch.float16),
            3,
            ops.Block(row_offset=10, col_offset=7, logical_rows=20, logical_cols=200),
        ),
    ]


def _bits(items):
    return [w.view(torch.int16 if w.element_size() == 2 else torch.int32).clone() for w, _, _ in items]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("noise", ["gaussian", "gaussian-icdf", "rademacher", "lowrank:2"])
def test_each_member_of_a_prepared_call_is_the_eager_op(backend, noise):
    items = _weights()
    base = [w.clone() for w, _, _ in items]
    p = ops.Prepared(items, noise=noise, backend=backend)
    for seed, c in [(5, 1e-2), (2**64 - 1, -3e-3), (5, -1e-2), (123456789, 0.5)]:
        p.set_members([seed], [c])
        with ops.counting() as n:
            p.apply()
        assert n["h2d"] == 0  # the graph-capturable part copies nothing from the host
        got = _bits(items)
        for (w, _, _), b in zip(items, base):
            w.copy_(b)
        ops.es_update_many_(items, [seed], [c], noise=noise, backend=backend)
        want = _bits(items)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (seed, c)
        for (w, _, _), b in zip(items, base):
            w.copy_(b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prepared_update_with_several_members_is_the_eager_update(backend):
    items = _weights(1)
    base = [w.clone() for w, _, _ in items]
    p = ops.Prepared(items, members=3, scales=[1.0, 0.5, 2.0], backend=backend)
    seeds, coeffs = [1, 2**63, 77], [0.25, -1.5, 3e-4]
    p.set_members(seeds, coeffs)
    p.apply()
    got = _bits(items)
    for (w, _, _), b in zip(items, base):
        w.copy_(b)
    ops.es_update_many_(items, seeds, coeffs, scales=[1.0, 0.5, 2.0], backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(got, _bits(items)))


def test_bad_use_of_a_prepared_call_is_refused_with_the_weights_untouched():
    w = torch.randn(4, 8)
    before = w.clone()
    p = ops.Prepared([(w, 1, None)])
    with pytest.raises(RuntimeError, match="set_members before apply"):
        p.apply()
    with pytest.raises(ValueError, match="1 member"):
        p.set_members([1, 2], [0.1, 0.1])
    with pytest.raises(ValueError, match="finite"):
        p.set_members([1], [float("nan")])
    with pytest.raises(ValueError, match="members must be an int"):
        ops.Prepared([(w, 1, None)], members=0)
    assert torch.equal(w, before)
    p.set_members([1], [0.1])
    w.set_(torch.zeros(4, 8).untyped_storage())  # new storage under the same tensor
    with pytest.raises(RuntimeError, match=r"items\[0\] moved"):
        p.apply()


def test_an_empty_prepared_call_does_nothing():
    p = ops.Prepared([(torch.empty(0, 5), 1, None)])
    p.set_members([3], [1.0])
    with ops.counting() as n:
        p.apply()
    assert n == {"launches": 0, "h2d": 0}


def test_staged_members_region_holds_seeds_then_coefficients():
    from espert.ops.backends import member_slots, write_members

    for n in (1, 2, 3):
        r = member_slots(n)
        s = np.arange(1, n + 1, dtype=np.uint64) << np.uint64(60)
        c = np.linspace(-1, 1, n).astype(np.float32)
        write_members(r, s, c)
        assert r[:n].view(np.uint64).tolist() == s.tolist()
        assert r[n + (n & 1) :].view(np.float32)[:n].tolist() == c.tolist()
