"""Weight decay on quantized centers scales the dequantized value, whatever the zero point."""

import pytest
import torch

from espert.quant import QuantCenterStore, QuantParamView, logical_scales, logical_zeros, quantize_weight


@pytest.mark.parametrize("fmt", ["int8", "fp8", "gptq", "awq"])
def test_scale_multiplies_the_dequantized_master(fmt):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    qw = quantize_weight(w, fmt, group_size=32)
    store = QuantCenterStore([QuantParamView("layer.weight", qw)])
    z, s = logical_zeros(qw), logical_scales(qw)
    before = (store.centers[0] - z) * s
    store.scale(0.5)
    after = (store.centers[0] - z) * s
    torch.testing.assert_close(after, 0.5 * before, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="scale factor"):
        store.scale(float("nan"))


def test_the_one_op_surface_dispatches_quantized_layouts():
    """espert.ops.perturb_ / es_update_ / restore_ take a QuantWeight and use the lattice kernels (checked
    against the numpy reference backend of the same registry)."""
    from espert import ops

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.02
    a, b = quantize_weight(w, "gptq", group_size=64), quantize_weight(w, "gptq", group_size=64)
    center = a.qweight.clone()
    ops.perturb_(a, 5, 9, 0.02, -1)
    ops.perturb_(b, 5, 9, 0.02, -1, backend="reference")
    assert torch.equal(a.qweight, b.qweight) and not torch.equal(a.qweight, center)
    ops.restore_(a, center)
    assert torch.equal(a.qweight, center)
    ops.es_update_(a, [1, 2], [0.01, -0.01], 9)
    c = quantize_weight(w, "gptq", group_size=64)
    ops.es_update_(c, [1, 2], [0.01, -0.01], 9, backend="reference")
    assert torch.equal(a.qweight, c.qweight)
    with pytest.raises(ValueError, match="master= is only for quantized"):
        ops.es_update_(torch.zeros(4), [1], [0.1], 9, master=torch.zeros(4))


def test_one_backend_registry_serves_float_and_quantized_weights(monkeypatch):
    """One registry (ops.BACKENDS) and one environment variable (ESPERT_BACKEND) for every weight type."""
    from espert import ops

    qw = quantize_weight(torch.randn(16, 64) * 0.02, "int8")
    assert "reference" in ops.available_backends(qw.qweight, "quant")
    assert "reference" not in ops.available_backends(torch.zeros(4))
    monkeypatch.setenv("ESPERT_BACKEND", "reference")
    before = qw.qweight.clone()
    ops.perturb_(qw, 1, 2, 0.05)  # runs on the reference backend
    assert not torch.equal(before, qw.qweight)
    with pytest.raises(ValueError, match="no float kernels"):
        ops.perturb_(torch.zeros(4), 1, 2, 0.05)
    monkeypatch.setenv("ESPERT_BACKEND", "nope")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        ops.perturb_(qw, 1, 2, 0.05)


def test_quantized_noise_family_errors_and_one_row_lowrank():
    from espert import ops

    qw = quantize_weight(torch.randn(16, 64) * 0.02, "int8")
    before = qw.qweight.clone()
    with pytest.raises(ValueError, match="unknown noise family 'uniform'"):
        ops.perturb_(qw, 1, 2, 0.05, noise="uniform")
    with pytest.raises(ValueError, match="unknown noise family"):
        QuantCenterStore([QuantParamView("layer.weight", qw)], noise="lowrank")
    with pytest.raises(ValueError, match="lowrank:1024 with 300 members .* more than 64 MiB of staging"):
        ops.es_update_(qw, list(range(300)), [0.1] * 300, 2, master=torch.zeros(16, 64), noise="lowrank:1024")
    assert torch.equal(before, qw.qweight)
    # a 1-row parameter takes the Gaussian under lowrank (docs/noise.md §5.2), as float weights do
    row = quantize_weight(torch.randn(1, 64) * 0.02, "int8")
    a, b = row.clone(), row.clone()
    ops.perturb_(a, 1, 2, 0.05, noise="lowrank:4")
    ops.perturb_(b, 1, 2, 0.05, noise="gaussian")
    assert torch.equal(a.qweight, b.qweight) and not torch.equal(a.qweight, row.qweight)
