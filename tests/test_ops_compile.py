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


@pytest.mark.parametrize(
    "call",
    [
        lambda w: ops.perturb_(w, 1, 2, 1e-40),  # subnormal in float32
        lambda w: ops.perturb_(w, 1, 2, float("nan")),
        lambda w: ops.es_update_(w, [1, 2], [1e-3, float("inf")], 2),
        lambda w: ops.perturb_(w, 1, 2, 1e-3, block=ops.Block(1, 0, 8, 16)),
    ],
)
def test_compiled_bad_calls_raise_and_leave_the_weight_untouched(call):
    w = torch.zeros(8, 16)

    def step(w):
        call(w)
        return w

    with pytest.raises(Exception, match="sigma|finite|outside the logical shape"):
        _compiled(step)(w)
    assert w.abs().sum() == 0
