"""torch.ops.espert.*: the ops as torch operators (torch.compile sees them; same bits as espert.ops)."""

import pytest
import torch

from espert import ops
from espert.params import torch_param_views


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).requires_grad_(False)


def test_operators_equal_the_python_ops():
    a, b = _model(), _model()
    items_a = [(v.tensor, v.key, v.block) for v in torch_param_views(a)]
    items_b = [(v.tensor, v.key, v.block) for v in torch_param_views(b)]
    ws, keys, blocks = ops.op_args(items_a)
    torch.ops.espert.perturb_(ws, keys, blocks, ops.as_int64(2**64 - 5), 1e-2, -1)
    ops.perturb_many_(items_b, 2**64 - 5, 1e-2, -1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    seeds = torch.tensor([ops.as_int64(1), ops.as_int64(2**63 + 1)])
    torch.ops.espert.es_update_(ws, keys, blocks, seeds, torch.tensor([1e-3, -2e-3]))
    ops.es_update_many_(items_b, [1, 2**63 + 1], [1e-3, -2e-3])
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_compiled_perturb_forward_restore_has_no_graph_break():
    """torch.compile(fullgraph=True) of perturb -> forward -> restore: fullgraph raises on any graph break."""
    model = _model()
    views = torch_param_views(model)
    ws, keys, blocks = ops.op_args([(v.tensor, v.key, v.block) for v in views])
    centers = [v.tensor.clone() for v in views]
    x = torch.randn(4, 16)
    clean = model(x)

    def step(x):
        torch.ops.espert.perturb_(ws, keys, blocks, 7, 1e-2, 1)
        y = model(x)
        for w, c in zip(ws, centers):
            torch.ops.espert.restore_(w, c)
        return y

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    ops.perturb_many_([(v.tensor, v.key, v.block) for v in views], 7, 1e-2, 1)
    eager = model(x)
    for w, c in zip(ws, centers):
        ops.restore_(w, c)
    assert torch.equal(y, eager) and not torch.equal(y, clean)
    assert torch.equal(model(x), clean)  # restored inside the compiled graph


def test_operator_errors_leave_weights_untouched():
    w = torch.zeros(4, 8)
    ws, keys, blocks = ops.op_args([(w, 3, None)])
    with pytest.raises(ValueError, match="outside the logical shape"):
        torch.ops.espert.perturb_(ws, keys, [0, 0, 2, 8], 1, 1e-2)
    with pytest.raises(ValueError, match="sign"):
        torch.ops.espert.perturb_(ws, keys, blocks, 1, 1e-2, 3)
    assert w.abs().sum() == 0
