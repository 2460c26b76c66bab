"""The README's public calls (``espert.ops.perturb_ / es_update_ / restore_``) inside
``torch.compile(fullgraph=True)``: no graph break, and the same bits as the eager calls."""

import pytest
import torch

from espert import ops
from espert.noise import param_key

KEY = param_key("model.layers.0.mlp.up_proj.weight")


def _w():
    torch.manual_seed(0)
    return torch.randn(64, 48).to(torch.bfloat16)  # the README's bf16 weight, smaller


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def test_readme_perturb_and_update_compile_to_the_eager_bits():
    def step(w, key):
        ops.perturb_(w, seed=17, key=key, sigma=1e-3, sign=+1)  # the README's calls, verbatim
        ops.es_update_(w, seeds=[1, 2, 3], coeffs=[1e-4, -2e-4, 5e-5], key=key)
        return w

    w, ref = _w(), _w()
    _compiled(step)(w, KEY)
    step(ref, KEY)
    assert torch.equal(w.view(torch.int16), ref.view(torch.int16))
    assert not torch.equal(w, _w())


def test_readme_block_call_and_restore_compile():
    block = ops.Block(row_offset=16, logical_rows=128, logical_cols=48)
    center = _w()

    def step(w, x):
        ops.perturb_(w[:16], 17, KEY, 1e-3, block=block)
        ops.perturb_(w, 2**64 - 5, 2**63 + 7, 0.5, -1, noise="rademacher")
        y = x @ w.float().t()
        ops.restore_(w, center.float())
        return y

    x = torch.randn(3, 48)
    w, ref = _w(), _w()
    y = _compiled(step)(w, x)
    assert torch.equal(y, step(ref, x))
    assert torch.equal(w.view(torch.int16), center.view(torch.int16))  # restored inside the graph


def test_compiled_float32_seeds_above_2_63_and_lowrank_match_eager():
    def step(w):
        ops.es_update_(w, [2**63 + 1, 5], [1e-3, -2e-3], 99, noise="lowrank:2")
        ops.perturb_(w, 2**64 - 1, 3, 1e-2, -1)
        return w

    w = torch.randn(8, 16)
    ref = w.clone()
    _compiled(step)(w)
    step(ref)
    assert torch.equal(w.view(torch.int32), ref.view(torch.int32))


def _step(call):
    def step(w):
        call(w)
        return w

    return step


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda w: ops.es_update_(w, [1, 2], [1e-3, float("inf")], 2), "coefficients must be finite"),
        (lambda w: ops.es_update_(w, [1], [1e39], 2), "overflow float32"),
        (lambda w: ops.perturb_(w, 1, 2, 1e-3, block=ops.Block(1, 0, 8, 16)), "outside the logical shape"),
        (lambda w: ops.perturb_(w, 1, 2, 1e-3, noise="lowrank:0"), "lowrank"),
        (lambda w: ops.perturb_(w.t(), 1, 2, 1e-3), "unit stride"),
        (lambda w: ops.restore_(w, torch.zeros(8, 15)), "does not match"),
    ],
)
def test_compiled_calls_are_checked_when_the_operator_runs(call, match):
    """What depends on the tensors is checked by the operator, with the eager error, before any write."""
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=match):
        _compiled(_step(call))(w)
    assert w.abs().sum() == 0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda w: ops.perturb_(w, 1, 2, 1e-40), "subnormal"),
        (lambda w: ops.perturb_(w, 1, 2, float("nan")), "sigma must be a finite number"),
        (lambda w: ops.perturb_(w, 1, 2, True), "sigma must be a finite number"),
        (lambda w: ops.perturb_(w, 1, 2, 1e-3, sign=1.0), "sign must be the int"),
        (lambda w: ops.perturb_(w, 2**64, 2, 1e-3), r"seeds\[0\] must be in"),
        (lambda w: ops.es_update_(w, [1, -1], [1e-3, 1e-3], 2), r"seeds\[1\] must be in"),
        (lambda w: ops.es_update_(w, [1], [1e-3], 2**64), "key must be in"),
    ],
)
def test_compiled_calls_are_checked_while_tracing(call, match):
    """σ, sign, seeds and keys (the operator's scalar arguments) are checked by the eager rules while
    Dynamo traces: fullgraph reports the ValueError (an exception is a graph break), and without
    fullgraph the call falls back to eager and raises it as is."""
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=match):
        call(w)  # eager
    with pytest.raises(torch._dynamo.exc.Unsupported, match="ValueError.*" + match):
        _compiled(_step(call))(w)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=match):
        torch.compile(_step(call), backend="aot_eager")(w)
    assert w.abs().sum() == 0
